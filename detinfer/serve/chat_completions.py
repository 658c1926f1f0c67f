"""``POST /v1/chat/completions``: render the messages (and tools) with the chat template, generate, and answer with
the reply's text or its tool calls, streamed or whole.

Messages are taken as OpenAI clients send them (``developer`` as ``system``, text content parts joined, assistant
``tool_calls`` with their arguments as objects for the template, as HF transformers passes them). ``tool_choice``
required / named and ``response_format`` are constraints (compiled before any token, a 400 if bad; enforced as
schemas.py says); a ``strict`` tool's schema is checked when the request arrives (a 400 naming the tool) and its
generated arguments are validated with bounded work (schemas.ArgumentsValidator). Logprobs
(``logprobs`` + ``top_logprobs`` 0..20) are those of the model's raw next-token distribution, before temperature
and top-p, with the fixed summation order of ``sampler.log_softmax_at``: they do not depend on the sampling
parameters and the greedy token is always top-1; top lists are highest first, ties by the lowest token id, one entry
per sampled token (an end-of-generation token and a stop string's tokens included).
"""

from __future__ import annotations

import json
from typing import Any

from ..compute.constrain import check_ignore_eos
from ..compute.generate import GenerationResult, Step
from ..errors import ConstraintError
from ..fileio import parse_json
from ..model.chat import unanswered_tool_result
from ..model.tool_parsers import Reply
from .protocol import ApiError, ChatRequest
from .schemas import ArgumentsValidator
from .serving import Server, finite
from .worker import Job


def arguments_object(arguments: str, param: str) -> Any:
    """Tool call arguments as the object they encode, or the text as it is when it is not JSON; ApiError 400 naming
    ``param`` for JSON nested deeper than the JSON inputs' limit (fileio.MAX_JSON_DEPTH)."""
    try:
        json.loads(arguments)
    except ValueError:
        return arguments
    except RecursionError:
        pass  # deeper than Python's recursion limit: parse_json says so
    value = parse_json(arguments, lambda msg: ApiError(400, msg, param=param, code="invalid_value"), "tool call arguments", param)
    return value if isinstance(value, dict) else arguments


class ChatCompletions:
    id_prefix, object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(self, server: Server):
        self.server = server

    def prepare(self, req: ChatRequest) -> Job:
        """The job of a chat request (in a thread): its prompt token ids, sampling, constraint and tools."""
        server = self.server
        engine, tpl = server.engine, server.template()
        fmt = server.tool_format(req.tools)
        messages = [m.template_dict(i) for i, m in enumerate(req.messages)]
        if (i := unanswered_tool_result(messages)) is not None:
            raise ApiError(400, f"messages.{i}.tool_call_id {messages[i]['tool_call_id']!r} is not the id of a call in the "
                           "preceding assistant message's tool_calls", param=f"messages.{i}.tool_call_id", code="invalid_value")  # fmt: skip
        for i, msg in enumerate(messages):  # HF templates expect arguments as objects (transformers' chat template docs)
            for j, call in enumerate(msg.get("tool_calls", [])):
                call["function"]["arguments"] = arguments_object(call["function"]["arguments"], f"messages.{i}.tool_calls.{j}.function.arguments")
        validators = {t.function.name: self._validator(t.function.model_dump(exclude_none=True), i)
                      for i, t in enumerate(req.tools or []) if t.function.strict}  # fmt: skip
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        prompt = tpl.encode(engine.tokenizer, tpl.render_with(engine.tokenizer, messages, tools=tools))
        server.check_length(prompt, "messages")
        limit = req.max_completion_tokens or req.max_tokens
        job = Job(prompt, req.sampling(limit or engine.n_ctx - len(prompt)), stream=bool(req.stream), messages=messages,
                  tool_defs=tools, logprobs_k=req.logprobs_k, constraint=req.constraint(fmt if req.forces_tool_call else None))  # fmt: skip
        try:
            check_ignore_eos(job.constraint, job.sampling.ignore_eos)
        except ConstraintError as e:
            raise ApiError(400, str(e).replace("--ignore-eos", "ignore_eos"), param="ignore_eos", code="invalid_value") from None
        server.check_constraint(job, "tool_choice" if req.forces_tool_call else "response_format")
        if req.tools and req.tool_choice != "none":
            job.tool_format = fmt
            # a forced call is generated under its grammar: no validation to do
            job.tools = {t.function.name: None if req.forces_tool_call else validators.get(t.function.name) for t in req.tools}
            job.parallel_tool_calls = req.parallel_tool_calls is not False
        return job

    def _validator(self, function: dict, i: int) -> ArgumentsValidator:
        """A strict tool's validator: its schema checked now, a 400 naming the tool if invalid or unsupported."""
        try:
            return ArgumentsValidator(function, self.server.engine.tokenizer)
        except ConstraintError as e:
            raise ApiError(400, f"tools.{i} (strict function {function['name']!r}): {e}", param=f"tools.{i}.function.parameters",
                           code="invalid_value") from None  # fmt: skip

    def message(self, reply: Reply, res: GenerationResult) -> dict[str, Any]:
        return {"message": reply.message()}

    def opening(self) -> dict[str, Any]:
        return {"delta": {"role": "assistant", "content": ""}}

    def text(self, text: str) -> dict[str, Any]:
        return {"delta": {"content": text}}

    def calls(self, calls: list[dict[str, Any]]) -> dict[str, Any]:
        return {"delta": {"tool_calls": calls}}

    def closing(self) -> dict[str, Any]:
        return {"delta": {}}

    def logprobs(self, steps: list[Step], offset: int) -> dict[str, Any]:
        tok = self.server.engine.tokenizer

        def entry(token_id: int, logprob: float) -> dict:
            b = tok.token_bytes(token_id)
            return {"token": b.decode("utf-8", errors="replace"), "logprob": finite(logprob), "bytes": list(b)}

        content = [dict(entry(s.token, s.logprob), top_logprobs=[entry(i, v) for i, v in s.top_logprobs])
                   for s in steps if s.token is not None]  # fmt: skip
        return {"content": content, "refusal": None}

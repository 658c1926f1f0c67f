"""OpenAI's Responses API (``POST /v1/responses``) on top of the chat completions machinery.

A request's ``instructions`` and ``input`` items become chat messages (``message`` items by role, consecutive
``function_call`` items one assistant message with ``tool_calls``, ``function_call_output`` items ``tool`` messages),
its flat function tools chat ``tools``; the prompt is rendered, generated, recorded and replayed exactly like a chat
completion's. ``previous_response_id`` names an earlier response of this server: its conversation (input and reply,
without its instructions; kept in memory for the last ``MAX_REMEMBERED`` responses, and with ``--record`` also
in ``responses/<model sha256 prefix>/<id>.response`` there, so it survives a restart) comes before the new input. Output items are the
reply's text (a ``message``) and its calls (``function_call`` items); ids derive from the prompt and sampling,
never random. Streaming sends the Responses event sequence (``response.created`` ... ``response.completed``, or
``response.incomplete``). ``text.format`` (json_schema, json_object) is chat's ``response_format``, enforced, recorded
and replayed the same way. A reply cut by ``max_output_tokens`` is ``incomplete`` on the response and on its message
item, with ``incomplete_details.reason`` ``max_output_tokens``. Errors raised for the equivalent chat request name the
Responses parameter (``text.format``, ``max_output_tokens``, ``input``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from collections import OrderedDict
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from ..compute.generate import GenerationResult
from ..errors import InputError
from ..fileio import load_json, publish_new
from ..model.tool_parsers import Reply
from ..records.manifest import tokens_sha256
from .chat_completions import ChatCompletions, arguments_object
from .protocol import (
    SAMPLING_EXTENSIONS,
    ApiError,
    ChatRequest,
    NamedFunction,
    ResponsesRequest,
    parse,
    validation_error,
)
from .serving import (
    BoundedStream,
    Server,
    StreamSplitter,
    detinfer_hashes,
    detinfer_headers,
)
from .worker import Job

MAX_REMEMBERED = 256  # responses whose conversation previous_response_id can continue from memory
_RESPONSE_ID = re.compile(r"resp_[0-9a-f]{32}")
_log = logging.getLogger("detinfer.serve")
# a chat parameter -> the Responses parameter it comes from (for the 400s of the equivalent chat request)
_PARAMS = {"response_format": "text.format", "max_completion_tokens": "max_output_tokens", "messages": "input"}


def _responses_error(e: ApiError) -> ApiError:
    """``e`` with the chat parameter it names spelled as the Responses parameter it comes from."""
    if e.param is None:
        return e
    head, dot, rest = e.param.partition(".")
    if head == "messages":  # chat message indices are not input item indices (instructions, previous responses)
        e.param = "input"
    elif head in _PARAMS:
        e.param = _PARAMS[head] + dot + rest
    return e


def _text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{param}: expected a string or a list of text parts", param=param, code="invalid_value")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ApiError(400, f"{param}.{j}: only text parts are supported, got {kind!r}", param=f"{param}.{j}", code="unsupported_value")
        texts.append(part["text"])
    return "".join(texts)


def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The chat messages (OpenAI chat shape) of ``input``; ApiError naming an item it cannot honour."""
    messages: list[dict[str, Any]] = []
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    for i, item in enumerate(items):
        param, kind = f"input.{i}", item.get("type", "message")
        if kind == "message" and item.get("role") in ("system", "developer", "user", "assistant"):
            messages.append({"role": item["role"], "content": _text(item.get("content"), f"{param}.content")})
        elif kind == "function_call":
            if isinstance(item.get("arguments"), str):
                arguments_object(item["arguments"], f"{param}.arguments")  # the 400 names the input item
            call = {"id": item.get("call_id"), "type": "function", "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and (last.get("tool_calls") or i > 0 and items[i - 1].get("role") == "assistant"):
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": _text(item.get("output"), f"{param}.output")})
        else:
            raise ApiError(400, f"{param}: input items of type {kind!r} are not supported (message, function_call, "
                                "function_call_output are)", param=param, code="unsupported_value")  # fmt: skip
    return messages


def _id(prefix: str, job: Job, i: int = 0) -> str:
    """A response's or item's id: a hash of everything its output depends on (prompt, sampling, limits)."""
    key = f"{prefix}:{tokens_sha256(job.prompt)}:{job.sampling.model_dump_json()}:{i}"
    return f"{prefix}_" + hashlib.sha256(key.encode()).hexdigest()[:32]


def _incomplete(res: GenerationResult | None) -> bool:
    return res is not None and res.stop_reason in ("max_tokens", "length")


def output_items(reply: Reply, job: Job, res: GenerationResult) -> list[dict[str, Any]]:
    """The Responses ``output`` of a reply: a ``message`` item for its text (``incomplete`` when the reply was cut
    by the token limit), a ``function_call`` item per call."""
    items: list[dict[str, Any]] = []
    if reply.content is not None:
        status = "incomplete" if _incomplete(res) else "completed"
        items.append({"type": "message", "id": _id("msg", job), "status": status, "role": "assistant",
                      "content": [{"type": "output_text", "text": reply.content, "annotations": [], "logprobs": []}]})  # fmt: skip
    for i, call in enumerate(reply.tool_calls):
        items.append({"type": "function_call", "id": _id("fc", job, i), "call_id": call["id"], "status": "completed",
                      "name": call["function"]["name"], "arguments": call["function"]["arguments"]})  # fmt: skip
    return items


class Responses:
    """The /v1/responses endpoint of one Server, with the conversations of its recent responses."""

    def __init__(self, server: Server, chat: ChatCompletions):
        self.server, self.chat = server, chat
        self.remembered: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()
        record_dir = server.settings.record_dir
        # per model: a response id hashes prompt and sampling, and another model answers the same prompt otherwise
        self.folder = record_dir / "responses" / server.engine.model_file.sha256[:16] if record_dir is not None else None

    def _conversation(self, response_id: str) -> list[dict[str, Any]]:
        """The conversation of an earlier response: from memory, else from its file in the record folder (read as
        any input is: bounded, its JSON checked; its messages are then validated as a request's are)."""
        if response_id in self.remembered:
            return self.remembered[response_id]
        if self.folder is not None and _RESPONSE_ID.fullmatch(response_id):
            path = self.folder / f"{response_id}.response"
            try:
                data = load_json(path, InputError, "recorded response")
                if isinstance(data, dict) and data.get("id") == response_id and isinstance(data.get("conversation"), list):
                    return data["conversation"]
                _log.warning("%s: not a recorded response of this id; not used", path)
            except InputError as e:
                if path.exists():
                    _log.warning("%s; not used", e)
        where = ("nor one recorded in --record's folder" if self.folder is not None
                 else "of this server (start it with --record to keep them)")  # fmt: skip
        raise ApiError(400, f"previous_response_id {response_id!r} is not one of the last {MAX_REMEMBERED} responses {where}; "
                            "send the whole conversation as input",
                       param="previous_response_id", code="invalid_value")  # fmt: skip

    def _chat_request(self, req: ResponsesRequest) -> tuple[ChatRequest, list[dict[str, Any]]]:
        """The equivalent chat request, and the conversation (without instructions) a later response may continue."""
        messages = input_messages(req)
        if req.previous_response_id is not None:
            messages = self._conversation(req.previous_response_id) + messages
        # instructions are the request's own: a previous response's do not carry over (as OpenAI's)
        rendered = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + messages
        tools = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)} for t in req.tools or []]
        choice = req.tool_choice
        if isinstance(choice, NamedFunction):
            choice = {"type": "function", "function": {"name": choice.name}}
        fmt = req.text.format if req.text is not None else None
        chat = {"model": req.model, "messages": rendered, "tools": tools or None, "tool_choice": choice,
                "parallel_tool_calls": req.parallel_tool_calls, "temperature": req.temperature, "top_p": req.top_p,
                "max_completion_tokens": req.max_output_tokens, "stream": req.stream, "user": req.user,
                "response_format": fmt.response_format() if fmt is not None else None,
                **{name: getattr(req, name) for name in SAMPLING_EXTENSIONS}}  # fmt: skip
        try:
            return ChatRequest.model_validate({k: v for k, v in chat.items() if v is not None}), messages
        except ValidationError as e:
            raise _responses_error(validation_error(e)) from None

    def _remember(self, job: Job, messages: list[dict[str, Any]], reply: Reply) -> str:
        response_id = _id("resp", job)
        conversation = self.remembered[response_id] = messages + [reply.message()]
        self.remembered.move_to_end(response_id)
        while len(self.remembered) > MAX_REMEMBERED:
            self.remembered.popitem(last=False)
        if self.folder is not None:  # the id hashes prompt and sampling, so a file already there holds this conversation
            data = json.dumps({"id": response_id, "conversation": conversation}, ensure_ascii=False, sort_keys=True)
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
                publish_new(self.folder / f"{response_id}.response", data.encode())
            except OSError as e:
                _log.warning("could not record response %s in %s (%s); it can be continued until a restart",
                             response_id, self.folder, e.strerror or e)  # fmt: skip
        return response_id

    def _body(self, req: ResponsesRequest, response_id: str | None, created: int, output: list, res: GenerationResult | None,
              n_prompt: int) -> dict[str, Any]:  # fmt: skip
        incomplete = _incomplete(res)
        status = "in_progress" if res is None else "incomplete" if incomplete else "completed"
        body = {"id": response_id, "object": "response", "created_at": created, "status": status, "model": self.server.model_id,
                "output": output, "instructions": req.instructions, "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
                "tool_choice": req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedFunction) else req.tool_choice or "auto", "parallel_tool_calls": req.parallel_tool_calls is not False,
                "temperature": 1.0 if req.temperature is None else req.temperature, "top_p": 1.0 if req.top_p is None else req.top_p,
                "max_output_tokens": req.max_output_tokens, "previous_response_id": req.previous_response_id,
                "metadata": req.metadata or {}, "truncation": "disabled", "error": None,
                "text": {"format": req.text.format.model_dump(by_alias=True, exclude_none=True)
                         if req.text is not None and req.text.format is not None else {"type": "text"}},
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None, "store": req.store is not False,
                "user": req.user, "usage": None}  # fmt: skip
        if res is not None:
            body["usage"] = {"input_tokens": n_prompt, "input_tokens_details": {"cached_tokens": res.reused_tokens},
                             "output_tokens": len(res.tokens), "output_tokens_details": {"reasoning_tokens": 0},
                             "total_tokens": n_prompt + len(res.tokens)}  # fmt: skip
        return body

    async def serve(self, request: Request, data: dict) -> Response:
        req = parse(ResponsesRequest, data)
        self.server.check_model(req.model)
        try:
            chat, messages = self._chat_request(req)
            chat.check()
            job, events, release = await self.server.submit(lambda: self.chat.prepare(chat))
        except ApiError as e:
            raise _responses_error(e) from None
        created = int(time.time())
        if req.stream:
            if not await self.server.started(request, job, events, release):
                return Response(status_code=499)
            return BoundedStream(self._events(req, job, events, release, messages, created), self.server.settings.send_timeout)
        done = await self.server.collect(request, job, events, release)
        if done is None:
            return Response(status_code=499)
        res, reply, _ = done
        body = self._body(req, self._remember(job, messages, reply), created, output_items(reply, job, res), res, len(job.prompt))
        return JSONResponse(body, headers=detinfer_headers(res, job))

    async def _events(self, req: ResponsesRequest, job: Job, events, release, messages: list[dict[str, Any]], created: int):
        """The Responses event stream: text deltas as they are generated (call markup held back), then the items."""
        seq = 0

        def event(kind: str, **fields: Any) -> str:
            nonlocal seq
            seq += 1
            return f"event: {kind}\ndata: " + json.dumps({"type": kind, "sequence_number": seq - 1, **fields}, ensure_ascii=False) + "\n\n"

        splitter = StreamSplitter(job.tool_format) if job.tool_format is not None else None
        streamed, message_open = "", False
        pending = self._body(req, _id("resp", job), created, [], None, len(job.prompt))
        message_id = _id("msg", job)

        def text_delta(delta: str) -> list[str]:
            nonlocal streamed, message_open
            out = []
            if not message_open:
                message_open = True
                item = {"type": "message", "id": message_id, "status": "in_progress", "role": "assistant", "content": []}
                out += [event("response.output_item.added", output_index=0, item=item),
                        event("response.content_part.added", item_id=message_id, output_index=0, content_index=0,
                              part={"type": "output_text", "text": "", "annotations": []})]  # fmt: skip
            streamed += delta
            out.append(event("response.output_text.delta", item_id=message_id, output_index=0, content_index=0, delta=delta, logprobs=[]))
            return out

        try:
            yield event("response.created", response=pending)
            yield event("response.in_progress", response=pending)
            while True:
                kind, payload = await events.get()
                if kind == "error":
                    yield event("error", code=payload.code, message=payload.message, param=payload.param)
                    return
                if kind == "step":
                    delta = payload.text if splitter is None else splitter.feed(payload.text)
                    for chunk in text_delta(delta) if delta else []:
                        yield chunk
                    continue
                if kind == "done":
                    break
            res, reply = payload
            rest = splitter.rest(reply, res.text) if splitter is not None else ""
            for chunk in text_delta(rest) if rest else []:
                yield chunk
            items = output_items(reply, job, res)
            for index, item in enumerate(items):
                if item["type"] == "message":  # its text was streamed above
                    part = item["content"][0]
                    yield event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0, text=part["text"], logprobs=[])
                    yield event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part)
                else:
                    yield event("response.output_item.added", output_index=index, item=dict(item, arguments="", status="in_progress"))
                    yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index, delta=item["arguments"])
                    yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index, arguments=item["arguments"])
                yield event("response.output_item.done", output_index=index, item=item)
            body = self._body(req, self._remember(job, messages, reply), created, items, res, len(job.prompt))
            body["detinfer"] = detinfer_hashes(res, job)
            yield event("response.completed" if body["status"] == "completed" else "response.incomplete", response=body)
        finally:
            job.cancel.set()
            release()

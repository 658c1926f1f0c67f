"""``POST /v1/completions``: continue a raw prompt (text, or token ids), streamed or whole; 16 tokens by default,
as OpenAI's.

Logprobs (``logprobs`` 0..5) are the raw distribution's, as for chat (see chat_completions.py); ``top_logprobs``
also hold the sampled token (OpenAI's "up to logprobs + 1"), keyed by token text (the first, higher-ranked entry
wins if two tokens share a text); ``text_offset`` counts characters of the returned completion text.
"""

from __future__ import annotations

from typing import Any

from ..compute.generate import GenerationResult, Step
from ..model.tool_parsers import Reply
from .protocol import ApiError, CompletionRequest
from .serving import Server, finite
from .worker import Job

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
NOTE = "raw /v1/completions prompt (no chat template)"


class Completions:
    id_prefix, object, chunk_object = "cmpl", "text_completion", "text_completion"

    def __init__(self, server: Server):
        self.server = server

    def prompt(self, req: CompletionRequest) -> list[int]:
        p, engine = req.prompt, self.server.engine
        if isinstance(p, list) and (not p or isinstance(p[0], int)):
            bad = [t for t in p if not 0 <= t < engine.config.n_vocab]
            if bad:
                raise ApiError(400, f"prompt: token id {bad[0]} is outside the vocabulary", param="prompt", code="invalid_value")
            return list(p)
        text = p if isinstance(p, str) else p[0]
        if text == "":
            raise ApiError(400, "prompt is empty", param="prompt", code="invalid_value")
        return engine.tokenizer.encode(text)

    def prepare(self, req: CompletionRequest) -> Job:
        prompt = self.prompt(req)
        self.server.check_length(prompt, "prompt")
        return Job(prompt, req.sampling(req.max_tokens or DEFAULT_MAX_TOKENS), stream=bool(req.stream), chat=False, note=NOTE,
                   logprobs_k=req.logprobs_k)  # fmt: skip

    def message(self, reply: Reply, res: GenerationResult) -> dict[str, Any]:
        return {"text": res.text}

    def opening(self) -> None:
        return None

    def text(self, text: str) -> dict[str, Any]:
        return {"text": text}

    def calls(self, calls: list[dict[str, Any]]) -> dict[str, Any]:
        raise AssertionError("a completion has no tool calls")

    def closing(self) -> dict[str, Any]:
        return {"text": ""}

    def logprobs(self, steps: list[Step], offset: int) -> dict[str, Any]:
        tok = self.server.engine.tokenizer
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for s in steps:
            if s.token is not None:
                top: dict[str, float] = {}
                for i, v in [*s.top_logprobs, (s.token, s.logprob)]:  # the sampled token too: up to logprobs + 1
                    top.setdefault(tok.token_bytes(i).decode("utf-8", errors="replace"), finite(v))
                out["tokens"].append(tok.token_bytes(s.token).decode("utf-8", errors="replace"))
                out["token_logprobs"].append(finite(s.logprob))
                out["top_logprobs"].append(top)
                out["text_offset"].append(offset)
            offset += len(s.text)
        return out

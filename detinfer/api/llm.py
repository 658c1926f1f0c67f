"""Loading a model and running it: complete prompts, chat, stream steps, run agent sessions.

Modelled on llama-cpp-python's ``Llama`` (``create_completion`` / ``create_chat_completion``)::

    import detinfer
    llm = detinfer.load()                       # the registry's default model, n_ctx 4096, f32 KV cache
    run = llm.chat([{"role": "user", "content": "Hi"}], max_tokens=16)
    run.text, run.tokens, run.stop_reason       # str, list[int], "eos" | "stop" | "stop_cut" | "max_tokens" | "length"
    run.manifest.save("run.json")               # the run manifest; `detinfer verify run.json` re-executes it

Every call is a pure function of the model file, the prompt and the sampling options: the same call gives the
same tokens, text and logits, bit for bit, at any thread count. Errors are :class:`detinfer.errors.DetinferError`
subclasses with a one-line message (InputError for a bad option or prompt, GGUFError for a bad model file, ...).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Generator

from ..compute.constrain import Constraint, check_ignore_eos
from ..compute.engine import (
    DEFAULT_CHUNK,
    PROGRESS_MARK,
    Engine,
    check_chunk_size,
    set_threads,
)
from ..compute.generate import OPENAI_FINISH_REASON, Step, check_prompt
from ..compute.prefix_cache import PrefixCache
from ..compute.sampling import Sampling, SamplingOverrides
from ..compute.speculate import check_speculate
from ..errors import InputError
from ..fileio import read_input_text, utf8_error
from ..model.chat import ChatTemplate, load_messages, validate_messages
from ..model.registry import resolve_model
from ..records.manifest import RunManifest
from ..records.run import build_prompt, execute_steps
from ..records.session import Conversation as SessionConversation
from ..records.session import (
    SessionRecord,
    SessionScript,
    TurnRecord,
    effective_sampling,
    load_script,
    new_record,
    parse_script,
    run_session,
    run_turn,
    write_session,
)

__all__ = ["LLM", "PROGRESS_MARK", "check_chunk_size", "Conversation", "Result", "SessionResult", "Stream", "constraint_from_options", "load", "load_messages",
           "read_prompt_file", "set_threads"]



@dataclass(frozen=True, eq=False)
class Result:
    """A finished run. ``manifest`` is its :class:`~detinfer.manifest.RunManifest` (``manifest.save(path)``
    writes it atomically; ``detinfer verify`` re-executes it). Compare results with ``detinfer_snapshot`` or by
    their manifests' ``contract()``, never with ``==`` (which is identity)."""

    manifest: RunManifest
    engine: Engine = field(repr=False)
    created: int = field(default_factory=lambda: int(time.time()), repr=False)  # unix seconds, for to_openai

    @property
    def text(self) -> str:
        """The generated text (a stop string is never part of it)."""
        return self.manifest.output.text

    @property
    def tokens(self) -> list[int]:
        """The generated token ids, including a final end-of-generation token."""
        return self.manifest.output.token_ids

    @property
    def prompt_tokens(self) -> list[int]:
        """The prompt's token ids (the chat template's rendering, for a chat)."""
        return self.manifest.prompt.token_ids

    @property
    def stop_reason(self) -> str:
        """"eos" (end-of-generation token), "stop" (a stop string), "stop_cut" (a stop string cut a constrained
        output short of its grammar's end), "max_tokens" or "length" (context full)."""
        return self.manifest.output.stop_reason

    @property
    def top_logits(self) -> list[list[tuple[int, float]]]:
        """Per step, the 5 highest (token id, logit) pairs, highest first (ties to the lowest id)."""
        return [[(int(i), float(v)) for i, v in step] for step in self.manifest.output.top_logits]

    def token_text(self, token_id: int) -> str:
        """The text of one token id under this run's tokenizer."""
        return self.engine.tokenizer.decode([token_id])

    def to_openai(self) -> dict[str, Any]:
        """An OpenAI-shaped response: a ``chat.completion`` for a chat, a ``text_completion`` otherwise, with
        exact ``usage``. ``id`` is derived from the output token hash, so the same run gives the same id."""
        m = self.manifest
        chat = m.prompt.chat
        choice: dict[str, Any] = {"index": 0, "finish_reason": OPENAI_FINISH_REASON[self.stop_reason], "logprobs": None}
        choice.update({"message": {"role": "assistant", "content": self.text}} if chat else {"text": self.text})
        n_prompt, n_out = len(self.prompt_tokens), len(self.tokens)
        return {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{m.output.tokens_sha256[:24]}",
            "object": "chat.completion" if chat else "text_completion",
            "created": self.created,
            "model": m.model.registry_name or Path(m.model.file_name).stem,
            "choices": [choice],
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out},
        }


class Stream:
    """An iterator over the :class:`~detinfer.generate.Step` s of one generation (token id, text delta, logits
    digest, top-5 logits, stop reason on the last). The prompt is built and checked when the stream is created
    (errors raise then); generation runs as you iterate. ``result`` is the :class:`Result` once it is exhausted
    (None before)."""

    def __init__(self, steps: Generator[Step, None, RunManifest], engine: Engine, threads: int | None, prompt_tokens: list[int]):
        self._steps, self._engine, self._threads = steps, engine, threads
        self.prompt_tokens = prompt_tokens  # the prompt's token ids
        self.result: Result | None = None

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Step:
        set_threads(self._threads)  # numba's thread count is per calling thread
        try:
            return next(self._steps)
        except StopIteration as done:
            if done.value is not None:
                self.result = Result(done.value, self._engine)
            raise StopIteration from None

    def finish(self) -> Result:
        """Run the rest of the generation and return its :class:`Result`."""
        for _ in self:
            pass
        assert self.result is not None
        return self.result


@dataclass(frozen=True, eq=False)
class SessionResult:
    """A finished agent session: ``record`` is its :class:`~detinfer.session.SessionRecord` (``detinfer replay``
    re-executes it); ``turns`` its per-turn records (messages, token ids, text, stop reason)."""

    record: SessionRecord
    engine: Engine = field(repr=False)

    @property
    def turns(self) -> list:
        return list(self.record.turns)

    @property
    def texts(self) -> list[str]:
        """Each turn's generated text."""
        return [t.text for t in self.record.turns]

    def token_text(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id])

    def save(self, path: str | os.PathLike) -> None:
        """Write the session record atomically (canonical JSON)."""
        write_session(self.record, path)


class LLM:
    """A loaded model with its KV-cache settings. Create with :func:`load`. Not safe to call from two threads at
    once (one KV cache is computed at a time, like the server's one decode worker)."""

    def __init__(self, engine: Engine, *, threads: int | None = None, chat_template: ChatTemplate | None = None,
                 speculate: str | None = None):  # fmt: skip
        self.engine, self.threads, self.chat_template = engine, threads, chat_template
        self.speculate = check_speculate(speculate)

    @property
    def model_sha256(self) -> str:
        return self.engine.model_file.sha256

    @property
    def n_ctx(self) -> int:
        return self.engine.n_ctx

    def __repr__(self) -> str:
        return f"LLM({self.engine.model_file.path.name!r}, n_ctx={self.n_ctx}, kv_type={self.engine.kv_type!r})"

    def complete(self, prompt: str, *, constraint: Constraint | None = None, **sampling: Any) -> Result:
        """Continue ``prompt`` (plain text, tokenized as typed with the model's BOS). Returns a :class:`Result`.
        ``constraint`` (e.g. ``Constraint.create("regex", "[0-9]+")``) makes the output match a grammar (recorded).

        Raises InputError for an empty or too-long prompt (more than n_ctx tokens) or a bad sampling option,
        ConstraintError for a bad constraint."""
        return self.stream(prompt, constraint=constraint, **sampling).finish()

    def chat(self, messages: str | list[dict[str, Any]], *, constraint: Constraint | None = None,
             **sampling: Any) -> Result:  # fmt: skip
        """Answer a conversation: ``messages`` is a list of ``{"role", "content"}`` dicts (or a string: one user
        message) rendered by the chat template (the model's, or ``load(chat_template=...)``); ``constraint`` as
        for :meth:`complete` (e.g. ``json_schema_constraint(schema)`` from detinfer.constrain).

        Raises InputError for malformed messages, TemplateError if the model has no chat template."""
        return self.stream(messages=messages, constraint=constraint, **sampling).finish()

    def stream(self, prompt: str | None = None, *, messages: str | list[dict[str, Any]] | None = None,
               chunk_size: int = DEFAULT_CHUNK, constraint: Constraint | None = None,
               **sampling: Any) -> Stream:  # fmt: skip
        """Generate step by step: a completion of ``prompt``, or a chat answer to ``messages`` (exactly one of
        them). Returns a :class:`Stream` of Steps whose ``result`` is set at the end. ``chunk_size`` (prefill
        tokens per chunk) never changes a result. Raises like :meth:`complete` and :meth:`chat`, at the call."""
        if (prompt is None) == (messages is None):
            raise InputError("give exactly one of prompt (a completion) or messages (a chat)")
        check_chunk_size(chunk_size)
        record = Sampling.create(**sampling)
        check_ignore_eos(constraint, record.ignore_eos)
        if messages is not None:
            text, msgs = (messages, None) if isinstance(messages, str) else (None, validate_messages(messages))
            p = build_prompt(self.engine, text=text, messages=msgs, chat=True, template=self.chat_template)
        else:
            if not isinstance(prompt, str):
                raise InputError(f"prompt must be a string, got {type(prompt).__name__}; use messages= for a chat")
            if (bad := utf8_error(prompt)) is not None:
                raise InputError(f"the prompt is not valid UTF-8: {bad}")
            p = build_prompt(self.engine, text=prompt)
        check_prompt(self.engine, p.token_ids)
        if constraint is not None:
            constraint.check(self.engine.tokenizer)  # a bad grammar fails here, before any token
        template = self.chat_template if p.chat else None
        steps = execute_steps(self.engine, p, record, chunk_size=chunk_size, template=template, constraint=constraint,
                              speculate=self.speculate)
        return Stream(steps, self.engine, self.threads, p.token_ids)

    def warm_up(self) -> bool:
        """Compile (first run) or load from numba's cache every kernel this model's forward pass uses; True if any
        kernel compiled."""
        set_threads(self.threads)
        return self.engine.warm_up()

    def session(self, script: str | os.PathLike | dict[str, Any] | SessionScript, *, cache_bytes: int = 1 << 30,
                out: str | os.PathLike | None = None, kv_dir: str | os.PathLike | None = None,
                on_step: Callable[[Step], None] | None = None,
                on_turn: Callable[[int, Any], None] | None = None) -> SessionResult:  # fmt: skip
        """Run an agent session script (a file, a dict or a SessionScript: ``{"sampling": {...}, "turns":
        [{"messages": [...]}, ...]}``, see the README), turn by turn, keeping the conversation as token ids.
        ``out``: write the record there after every turn (a later failing turn loses nothing before it); ``kv_dir``:
        save the KV cache after each turn as ``turn-NNN.detkv``; ``on_step`` / ``on_turn(i, turn)``: progress.

        A script whose ``model`` names another model than the loaded one raises InputError."""
        if isinstance(script, SessionScript):
            sc = script
        elif isinstance(script, dict):
            sc = parse_script(script)
        else:
            sc = load_script(script)
        if sc.model is not None and resolve_model(sc.model).resolve() != self.engine.model_file.path.resolve():
            raise InputError(f"the session script names model {sc.model!r} but {self.engine.model_file.path.name} is "
                             "loaded; drop the script's model or load that one")  # fmt: skip
        set_threads(self.threads)
        record = run_session(self.engine, sc.turns, sc.sampling, prefix_cache=PrefixCache(cache_bytes), template=self.chat_template,
                             out=out, kv_dir=kv_dir, on_step=on_step, on_turn=on_turn, speculate=self.speculate)  # fmt: skip
        return SessionResult(record, self.engine)

    def conversation(self, *, system: str | None = None, **sampling: Any) -> Conversation:
        """An interactive conversation (``detinfer chat``): :meth:`Conversation.send` one user message at a time."""
        return Conversation(self, system=system, sampling=sampling)


class Conversation:
    """A conversation sent one user message at a time, kept as token ids like a scripted session; ``record`` is its
    session record (``detinfer replay`` re-executes it). ``sampling``: :class:`Sampling` options for every turn."""

    def __init__(self, llm: LLM, *, system: str | None = None, sampling: dict[str, Any] | None = None):
        self.llm, self.system = llm, system
        self.sampling = effective_sampling(SamplingOverrides(), None) | dict(sampling or {})
        Sampling.create(**self.sampling)  # a bad option fails here, before the first message
        self._conv = SessionConversation(llm.engine, llm.chat_template)
        self._cache = llm.engine.new_cache()
        self.turns: list[TurnRecord] = []

    def send(self, text: str, on_step: Callable[[Step], None] | None = None) -> TurnRecord:
        """Append a user message (after the system message, on the first turn) and generate the reply."""
        set_threads(self.llm.threads)
        messages = ([{"role": "system", "content": self.system}] if self.system and not self.turns else []) + [{"role": "user", "content": text}]
        self.turns.append(run_turn(self.llm.engine, self._conv, self._cache, messages, self.sampling, on_step=on_step,
                                   speculate=self.llm.speculate))
        return self.turns[-1]

    @property
    def record(self) -> SessionRecord:
        return new_record(self.llm.engine, self.turns, self.llm.chat_template)

    def save(self, path: str | os.PathLike) -> None:
        """Write the session record so far atomically (``detinfer replay`` re-executes it)."""
        write_session(self.record, path)


def load(model: str | os.PathLike | None = None, *, n_ctx: int = 4096, threads: int | None = None, kv_type: str = "f32",
         chat_template: str | os.PathLike | None = None, rederive: bool = False, speculate: str | None = None) -> LLM:  # fmt: skip
    """Load a model: a registry name (default ``smollm2-135m-instruct-q4_1``; it must have been downloaded with
    ``detinfer pull NAME``, else PullError) or a path to a ``.gguf`` file.

    n_ctx: KV cache positions (at most the model's context length); threads: numba threads (default as many cores as are free,
    chosen again as load changes; never changes a result); kv_type: "f32" or "f16" (quantized caches are refused: KVTypeError);
    chat_template: a built-in format ("gemma", "chatml") or a jinja file, for a model without its own;
    rederive: use no file derived from the model (GGUF index, tokenizer caches, repacked weights): all of it is
    computed from the GGUF alone and nothing is kept (same bytes, a slower load; numba's JIT cache is the caller's:
    point ``NUMBA_CACHE_DIR`` at a fresh folder before importing detinfer, as the CLI's ``--rederive`` does);
    speculate: "ngram" drafts tokens by prompt lookup and checks them in one forward (compute.speculate): the same
    tokens, digests and KV in fewer forwards where the output repeats its context (never changes a result).
    Raises PullError, GGUFError (missing, truncated or unsupported file), InputError (bad n_ctx, threads or
    speculate), KVTypeError.
    """
    set_threads(threads)
    check_speculate(speculate)
    template = ChatTemplate.from_option(str(chat_template)) if chat_template is not None else None
    return LLM(Engine.load(model, n_ctx=n_ctx, kv_type=kv_type, rederive=rederive), threads=threads, chat_template=template,
               speculate=speculate)


def read_prompt_file(path: str | os.PathLike) -> str:
    """A prompt from a UTF-8 file (``-``: stdin), at most 64 MiB; InputError naming a bad byte's offset."""
    return read_input_text(path, InputError, "prompt file", stdin=True)


def constraint_from_options(*, json_schema: str | os.PathLike | None = None, json_object: bool = False, regex: str | None = None,
                            grammar: str | os.PathLike | None = None, ignore_eos: bool = False) -> Constraint | None:  # fmt: skip
    """The constraint of ``detinfer run``'s --json-schema FILE / --json / --regex RE / --grammar FILE (at most one), or
    None; ConstraintError for a bad one or one with ``ignore_eos``, InputError for two at once."""
    given = [o for o, v in (("--json-schema", json_schema), ("--json", json_object or None), ("--regex", regex), ("--grammar", grammar))
             if v is not None]  # fmt: skip
    if len(given) > 1:
        raise InputError(f"give at most one constraint; got {', '.join(given)}")
    if json_schema is not None:
        constraint = Constraint.from_file("json_schema", json_schema, source="--json-schema")
    elif grammar is not None:
        constraint = Constraint.from_file("lark", grammar, source="--grammar")
    elif regex is not None:
        constraint = Constraint.create("regex", regex, source="--regex")
    else:
        constraint = Constraint.create("json_object") if json_object else None
    check_ignore_eos(constraint, ignore_eos)
    return constraint

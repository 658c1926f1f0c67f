"""Runs: build a prompt, generate, record a manifest; re-execute a manifest and compare what the contract covers.

This is the library API the CLI wraps; tests call it directly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Generator

import llvmlite
import numba
import numpy as np

from ..compute import constrain
from ..compute.constrain import Constraint
from ..compute.engine import DEFAULT_CHUNK, Engine
from ..compute.generate import GenerationResult, Step, generate
from ..compute.numerics import NUMERICS
from ..compute.sampling import Sampling
from ..errors import InputError, ManifestError, TemplateError
from ..model.chat import BUILTIN_TEMPLATES, ChatTemplate
from ..model.registry import REGISTRY
from ..version import __version__
from .machine import machine
from .manifest import (
    ChatTemplateRecord,
    EngineRecord,
    Informative,
    Message,
    ModelRecord,
    OutputRecord,
    PromptRecord,
    RunManifest,
    cpu_name,
    tokens_sha256,
)


def versions() -> dict[str, str]:
    """Versions of the libraries whose code computes the numbers."""
    return {"detinfer": __version__, "numba": numba.__version__, "llvmlite": llvmlite.__version__, "numpy": np.__version__,
            **constrain.version()}


def build_prompt(engine: Engine, *, text: str | None = None, messages: list[dict] | None = None, chat: bool = False,
                 template: ChatTemplate | None = None) -> PromptRecord:  # fmt: skip
    """Turn user input into a prompt record with exact token ids.

    Plain text is tokenized as typed (special-token strings stay text, BOS per the model). With ``chat`` (or
    ``messages``) a chat template renders the conversation and its special tokens are parsed: ``template`` if
    given (``--chat-template``: a jinja file or a built-in format), else the model's own. Built-in formats get
    the model's BOS from the tokenizer (as in llama.cpp); other templates write it themselves.
    Raises InputError for empty input, TemplateError if a chat prompt has no template to use.
    """
    tok = engine.tokenizer
    if messages is None and text is None:
        raise InputError("no prompt given; use --prompt, --prompt-file or --messages")
    if messages is not None or chat:
        template = template or engine.chat_template
        if template is None:
            raise TemplateError(
                f"{engine.model_file.path.name} has no chat template; pass --chat-template with a built-in format "
                f"({', '.join(BUILTIN_TEMPLATES)}) or a jinja file, or run without --chat"
            )
        msgs = messages if messages is not None else [{"role": "user", "content": text}]
        rendered = template.render_with(tok, msgs)
        ids = template.encode(tok, rendered)
        return PromptRecord(
            text=None if messages is not None else text,
            messages=[Message(role=m["role"], content=m["content"]) for m in msgs],
            chat=True,
            rendered=rendered,
            token_ids=ids,
            tokens_sha256=tokens_sha256(ids),
        )
    if text == "":
        raise InputError("the prompt is empty; a raw completion needs some text to continue")
    ids = tok.encode(text)
    return PromptRecord(text=text, messages=None, chat=False, rendered=text, token_ids=ids, tokens_sha256=tokens_sha256(ids))


def template_record(template: ChatTemplate | None) -> ChatTemplateRecord | None:
    """What a manifest keeps of a chat template that is not the model's own (None for the model's or none)."""
    if template is None or template.origin == "model":
        return None
    return ChatTemplateRecord(origin=template.origin, name=template.name or "", sha256=template.hash, source=template.source)


def recorded_template(manifest: RunManifest | Any) -> ChatTemplate | None:
    """The chat template a manifest (or session record: the same two fields) was rendered with, if it was not the
    model's own, rebuilt from the recorded text. Raises ManifestError if that text does not hash to what was
    recorded."""
    rec = manifest.chat_template
    if rec is None:
        return None
    if rec.sha256 != manifest.chat_template_sha256:
        raise ManifestError(f"chat_template.sha256 {rec.sha256[:16]}... differs from chat_template_sha256; the manifest is inconsistent")
    try:
        return ChatTemplate.from_record(rec.origin, rec.name, rec.source, rec.sha256)
    except TemplateError as e:
        raise ManifestError(f"the manifest's chat template cannot be used: {e}") from None


def model_record(engine: Engine) -> ModelRecord:
    mf = engine.model_file
    registry_name = next((e.name for e in REGISTRY.values() if e.sha256 == mf.sha256), None)
    return ModelRecord(
        file_name=mf.path.name,
        registry_name=registry_name,
        sha256=mf.sha256,
        architecture=mf.architecture,
        tensor_types=mf.type_counts(),
    )


def execute(
    engine: Engine,
    prompt: PromptRecord,
    sampling: Sampling,
    *,
    chunk_size: int = DEFAULT_CHUNK,
    on_step: Callable[[Step], None] | None = None,
    template: ChatTemplate | None = None,
    constraint: Constraint | None = None,
    speculate: str | None = None,
) -> RunManifest:
    """Generate from ``prompt`` with ``sampling`` and return the (sealed) manifest of the run.

    ``on_step`` is called for every step as it is produced (e.g. to stream text to a terminal). ``template``: the
    chat template ``build_prompt`` was given, recorded with its text unless it is the model's own. ``constraint``:
    the grammar the output must match (recorded as the ``constraint`` section, with the mask digest chain).
    ``speculate``: a drafter for speculative decoding (compute.speculate; never changes the manifest's contract,
    its counts go to the informative timings).
    """
    steps = execute_steps(engine, prompt, sampling, chunk_size=chunk_size, template=template, constraint=constraint,
                          speculate=speculate)
    while True:
        try:
            step = next(steps)
        except StopIteration as done:
            return done.value
        if on_step is not None:
            on_step(step)


def execute_steps(
    engine: Engine,
    prompt: PromptRecord,
    sampling: Sampling,
    *,
    chunk_size: int = DEFAULT_CHUNK,
    template: ChatTemplate | None = None,
    constraint: Constraint | None = None,
    speculate: str | None = None,
) -> Generator[Step, None, RunManifest]:
    """``execute`` as a generator: yields each Step as it is produced and returns the sealed manifest (the value
    of its StopIteration)."""
    res = GenerationResult()
    yield from generate(engine, prompt.token_ids, sampling, chunk_size=chunk_size, result=res, constraint=constraint,
                        speculate=speculate)
    output = OutputRecord(
        token_ids=res.tokens,
        text=res.text,
        stop_reason=res.stop_reason,
        tokens_sha256=tokens_sha256(res.tokens),
        kv_sha256=res.kv_sha256,
        logits_digests=res.digests,
        top_logits=[list(t) for t in res.top],
        mask_digests=res.mask_digests if constraint is not None else None,
    )
    return RunManifest(
        model=model_record(engine),
        tokenizer_sha256=engine.tokenizer.hash,
        chat_template_sha256=used.hash if (used := template or engine.chat_template) else None,
        chat_template=template_record(template) if prompt.chat else None,
        constraint=constraint,
        numerics=NUMERICS,
        prompt=prompt,
        sampling=sampling,
        engine=EngineRecord(n_ctx=engine.n_ctx, kv_type=engine.kv_type),
        output=output,
        informative=Informative(
            threads=numba.get_num_threads(),
            chunk_size=chunk_size,
            timings=res.timings.rates() | ({"draft_tokens": res.draft_tokens, "accepted_tokens": res.accepted_tokens} if speculate else {}),
            cpu=cpu_name(),
            versions=versions(),
            model_path=str(engine.model_file.path),
            machine=machine(),
        ),
    ).sealed()


@dataclass(frozen=True)
class Difference:
    """One contract field that differs between a recorded run and its re-execution."""

    field: str
    expected: str
    actual: str


@dataclass(frozen=True)
class Comparison:
    differences: tuple[Difference, ...]
    first_divergent_step: int | None

    @property
    def match(self) -> bool:
        return not self.differences


def compare(expected: RunManifest, actual: RunManifest) -> Comparison:
    """Compare the contract fields of two manifests: the numerics id, the model (all but its file name, which is where
    the file was, informative like ``informative.model_path``), inputs' hashes, output tokens, text, stop reason, KV
    hash, the logits digest chain and the top logits. ``first_divergent_step`` is the first step whose logits digest
    or token differs."""
    diffs: list[Difference] = []

    def check(name: str, a, b) -> None:
        if a != b:
            diffs.append(Difference(name, *excerpts(a, b)))

    check("numerics", expected.recorded_numerics(), actual.recorded_numerics())
    for field in ("sha256", "registry_name", "architecture", "tensor_types"):
        check(f"model.{field}", getattr(expected.model, field), getattr(actual.model, field))
    check("tokenizer_sha256", expected.tokenizer_sha256, actual.tokenizer_sha256)
    check("chat_template_sha256", expected.chat_template_sha256, actual.chat_template_sha256)
    check("chat_template", expected.chat_template, actual.chat_template)
    check("constraint", expected.constraint, actual.constraint)
    check("prompt.tokens_sha256", expected.prompt.tokens_sha256, actual.prompt.tokens_sha256)
    check("output.token_ids", expected.output.token_ids, actual.output.token_ids)
    check("output.text", expected.output.text, actual.output.text)
    check("output.stop_reason", expected.output.stop_reason, actual.output.stop_reason)
    check("output.kv_sha256", expected.output.kv_sha256, actual.output.kv_sha256)
    check("output.logits_digests", expected.output.logits_digests, actual.output.logits_digests)
    check("output.mask_digests", expected.output.mask_digests, actual.output.mask_digests)
    check("output.top_logits", expected.output.top_logits, actual.output.top_logits)
    # a digest differs before the token sampled from it, but an edited (re-sealed) manifest can differ in a token only
    firsts = [first_difference(expected.output.logits_digests, actual.output.logits_digests),
              first_difference(expected.output.mask_digests or [], actual.output.mask_digests or []),
              first_difference(expected.output.token_ids, actual.output.token_ids)]
    return Comparison(tuple(diffs), min((i for i in firsts if i is not None), default=None))


def first_difference(a: list, b: list) -> int | None:
    """First index where ``a`` and ``b`` differ (an index past the shorter one counts), or None if equal."""
    return next((i for i in range(max(len(a), len(b))) if i >= len(a) or i >= len(b) or a[i] != b[i]), None)


def excerpts(a, b, width: int = 80) -> tuple[str, str]:
    """Printable forms of two differing values, both cut to the same window of ``width`` characters that starts
    20 characters before their first differing character ("..." marks a cut), so long lists show where they differ;
    text is quoted with JSON's escapes, so a newline cannot break a report's line."""
    sa, sb = (json.dumps(x, ensure_ascii=False) if isinstance(x, str) else str(x) for x in (a, b))
    i = next((k for k, (x, y) in enumerate(zip(sa, sb)) if x != y), min(len(sa), len(sb)))
    start = max(0, i - 20)

    def cut(s: str) -> str:
        return ("..." if start else "") + s[start : start + width] + ("..." if start + width < len(s) else "")

    return cut(sa), cut(sb)


def reexecute_manifest(manifest: RunManifest, engine: Engine, *, chunk_size: int = DEFAULT_CHUNK, on_step=None,
                       speculate: str | None = None) -> tuple[RunManifest, Comparison]:
    """Run a recorded manifest's inputs again (its exact prompt token ids) and compare the contract fields."""
    if engine.model_file.sha256 != manifest.model.sha256:
        raise ManifestError("the manifest's model sha256 does not match the loaded model")
    p = manifest.prompt
    template = recorded_template(manifest)
    retokenized = build_prompt(engine, text=p.text, messages=[m.model_dump() for m in p.messages] if p.messages and p.text is None else None,
                               chat=p.chat, template=template)
    actual = execute(engine, p, manifest.sampling, chunk_size=chunk_size, on_step=on_step, template=template,
                     constraint=manifest.constraint, speculate=speculate)
    comparison = compare(manifest, actual)
    # every prompt field a reader reads is what the recorded inputs give: a resealed record cannot name a system
    # message or a rendered text the model never saw
    extra = tuple(Difference(f"prompt.{f} (rebuilt from the recorded input)", *excerpts(a, b))
                  for f in PromptRecord.model_fields
                  if (a := _plain(getattr(p, f))) != (b := _plain(getattr(retokenized, f))))  # fmt: skip
    if extra:
        comparison = Comparison(comparison.differences + extra, comparison.first_divergent_step)
    return actual, comparison


def _plain(value):
    """A prompt field as JSON data (messages as dicts), for comparing and printing."""
    return [m.model_dump() for m in value] if isinstance(value, list) and value and isinstance(value[0], Message) else value

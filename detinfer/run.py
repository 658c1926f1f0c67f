"""Runs: build a prompt, generate, record a manifest; re-execute a manifest and compare what the contract covers.

This is the library API the CLI wraps; tests call it directly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Sequence

import numba
import numpy as np
import llvmlite

from . import __version__
from .engine import DEFAULT_CHUNK, Engine
from .errors import InputError, ManifestError, TemplateError
from .generate import GenerationResult, Step, generate
from .manifest import (
    EngineRecord,
    Informative,
    Message,
    ModelRecord,
    OutputRecord,
    PromptRecord,
    RunManifest,
    SamplingRecord,
    cpu_name,
    tokens_sha256,
)
from .registry import REGISTRY
from .sampler import SamplingParams


def versions() -> dict[str, str]:
    """Versions of the libraries whose code computes the numbers."""
    return {"detinfer": __version__, "numba": numba.__version__, "llvmlite": llvmlite.__version__, "numpy": np.__version__}


def build_prompt(engine: Engine, *, text: str | None = None, messages: list[dict] | None = None, chat: bool = False) -> PromptRecord:
    """Turn user input into a prompt record with exact token ids.

    Plain text is tokenized as typed (special-token strings stay text, BOS per the model). With ``chat`` (or
    ``messages``) the model's chat template renders the conversation and its special tokens are parsed.
    Raises InputError for empty input, TemplateError if the model has no chat template.
    """
    tok = engine.tokenizer
    if messages is None and text is None:
        raise InputError("no prompt given; use --prompt, --prompt-file or --messages")
    if messages is not None or chat:
        if engine.chat_template is None:
            raise TemplateError(f"{engine.model_file.path.name} has no chat template; run without --chat")
        msgs = messages if messages is not None else [{"role": "user", "content": text}]
        bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else ""
        eos = tok.token_text(tok.eos_id) if tok.eos_id is not None else ""
        rendered = engine.chat_template.render(msgs, add_generation_prompt=True, bos_token=bos, eos_token=eos)
        ids = tok.encode(rendered, add_bos=False, parse_special=True)
        return PromptRecord(
            text=None if messages is not None else text,
            messages=[Message(role=m["role"], content=m["content"]) for m in msgs],
            chat=True,
            rendered=rendered,
            token_ids=ids,
            tokens_sha256=tokens_sha256(ids),
        )
    if text == "":
        raise InputError("the prompt is empty; pass some text with --prompt or --prompt-file")
    ids = tok.encode(text)
    return PromptRecord(text=text, messages=None, chat=False, rendered=text, token_ids=ids, tokens_sha256=tokens_sha256(ids))


def sampling_record(params: SamplingParams, *, max_tokens: int, stop: Sequence[str] = (), ignore_eos: bool = False) -> SamplingRecord:
    if max_tokens < 1:
        raise InputError(f"--max-tokens must be at least 1, got {max_tokens}")
    return SamplingRecord(**params.model_dump(), max_tokens=max_tokens, stop=list(stop), ignore_eos=ignore_eos)


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
    sampling: SamplingRecord,
    *,
    chunk_size: int = DEFAULT_CHUNK,
    on_step: Callable[[Step], None] | None = None,
) -> RunManifest:
    """Generate from ``prompt`` with ``sampling`` and return the (sealed) manifest of the run.

    ``on_step`` is called for every step as it is produced (e.g. to stream text to a terminal).
    """
    params = SamplingParams.from_dict(sampling.model_dump(exclude={"max_tokens", "stop", "ignore_eos"}))
    res = GenerationResult()
    for step in generate(
        engine,
        prompt.token_ids,
        params,
        max_tokens=sampling.max_tokens,
        stop=sampling.stop,
        ignore_eos=sampling.ignore_eos,
        chunk_size=chunk_size,
        result=res,
    ):
        if on_step is not None:
            on_step(step)
    output = OutputRecord(
        token_ids=res.tokens,
        text=res.text,
        stop_reason=res.stop_reason,
        tokens_sha256=tokens_sha256(res.tokens),
        kv_sha256=res.kv_sha256,
        logits_digests=res.digests,
        top_logits=[list(t) for t in res.top],
    )
    return RunManifest(
        model=model_record(engine),
        tokenizer_sha256=engine.tokenizer.hash,
        chat_template_sha256=engine.chat_template.hash if engine.chat_template else None,
        prompt=prompt,
        sampling=sampling,
        engine=EngineRecord(n_ctx=engine.n_ctx, kv_type=engine.kv_type),
        output=output,
        informative=Informative(
            threads=numba.get_num_threads(),
            chunk_size=chunk_size,
            timings=res.timings.rates(),
            cpu=cpu_name(),
            versions=versions(),
            model_path=str(engine.model_file.path),
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
    """Compare the contract fields of two manifests: inputs' hashes, output tokens, text, stop reason, KV hash
    and the logits digest chain. ``first_divergent_step`` is the first step whose logits digest or token differs."""
    diffs: list[Difference] = []

    def check(name: str, a, b) -> None:
        if a != b:
            diffs.append(Difference(name, _short(a), _short(b)))

    check("model.sha256", expected.model.sha256, actual.model.sha256)
    check("tokenizer_sha256", expected.tokenizer_sha256, actual.tokenizer_sha256)
    check("chat_template_sha256", expected.chat_template_sha256, actual.chat_template_sha256)
    check("prompt.tokens_sha256", expected.prompt.tokens_sha256, actual.prompt.tokens_sha256)
    check("output.token_ids", expected.output.token_ids, actual.output.token_ids)
    check("output.text", expected.output.text, actual.output.text)
    check("output.stop_reason", expected.output.stop_reason, actual.output.stop_reason)
    check("output.kv_sha256", expected.output.kv_sha256, actual.output.kv_sha256)
    check("output.logits_digests", expected.output.logits_digests, actual.output.logits_digests)
    # a digest differs before the token sampled from it, but an edited (re-sealed) manifest can differ in a token only
    firsts = [first_difference(expected.output.logits_digests, actual.output.logits_digests),
              first_difference(expected.output.token_ids, actual.output.token_ids)]
    return Comparison(tuple(diffs), min((i for i in firsts if i is not None), default=None))


def first_difference(a: list, b: list) -> int | None:
    """First index where ``a`` and ``b`` differ (an index past the shorter one counts), or None if equal."""
    return next((i for i in range(max(len(a), len(b))) if i >= len(a) or i >= len(b) or a[i] != b[i]), None)


def _short(value) -> str:
    text = str(value)
    return text if len(text) <= 80 else text[:77] + "..."


def engine_for_manifest(manifest: RunManifest, model: str | os.PathLike | None = None) -> Engine:
    """Load the model a manifest was recorded with (or ``model``) with the manifest's engine settings.

    Raises ManifestError if the model file's sha256 differs from the recorded one.
    """
    source = model if model is not None else manifest.model.registry_name or manifest.informative.model_path
    engine = Engine.load(source, n_ctx=manifest.engine.n_ctx, kv_type=manifest.engine.kv_type)
    if engine.model_file.sha256 != manifest.model.sha256:
        raise ManifestError(
            f"the manifest was recorded with model sha256 {manifest.model.sha256[:16]}... but "
            f"{engine.model_file.path} has sha256 {engine.model_file.sha256[:16]}...; pass the right file with --model"
        )
    return engine


def reexecute(manifest: RunManifest, engine: Engine, *, chunk_size: int = DEFAULT_CHUNK, on_step=None) -> tuple[RunManifest, Comparison]:
    """Run a recorded manifest's inputs again (its exact prompt token ids) and compare the contract fields."""
    if engine.model_file.sha256 != manifest.model.sha256:
        raise ManifestError("the manifest's model sha256 does not match the loaded model")
    p = manifest.prompt
    retokenized = build_prompt(engine, text=p.text, messages=[m.model_dump() for m in p.messages] if p.messages and p.text is None else None, chat=p.chat)
    actual = execute(engine, p, manifest.sampling, chunk_size=chunk_size, on_step=on_step)
    comparison = compare(manifest, actual)
    if retokenized.token_ids != p.token_ids:
        extra = Difference("prompt.token_ids (re-tokenized)", _short(p.token_ids), _short(retokenized.token_ids))
        comparison = Comparison(comparison.differences + (extra,), comparison.first_divergent_step)
    return actual, comparison

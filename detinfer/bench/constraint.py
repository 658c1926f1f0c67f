"""``detinfer bench constraint``: what the allowed-token mask of a JSON-schema constraint adds to decode time.

Both arms decode exactly the same number of tokens after the same prompt: the constrained arm under a schema whose
shortest valid output is far longer than the run (an array of at least 100 strings), so it never ends early; the
unconstrained arm with end tokens ignored. Runs alternate (unconstrained, constrained, ...) so a busy neighbour
slows both alike, and each arm's minimum decode time is compared: the overhead is min(constrained) / min(free) - 1.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..compute.constrain import json_schema_constraint
from ..compute.engine import Engine
from ..compute.generate import GenerationResult, generate
from ..compute.sampling import Sampling
from ..errors import InputError
from ..records.run import build_prompt
from .suite import busy_warning

PROMPT = "List as many fruits as you can, as JSON."
SCHEMA = {"type": "object", "properties": {"fruits": {"type": "array", "items": {"type": "string"}, "minItems": 100}},
          "required": ["fruits"], "additionalProperties": False}  # fmt: skip
OVERHEAD_LIMIT = 0.15  # the bound on what the mask may add to decode time


@dataclass(frozen=True)
class ConstraintBench:
    """Seconds of decode (all steps after prefill) per run of each arm, in run order, and the overhead."""

    tokens: int
    free_s: list[float]
    constrained_s: list[float]

    @property
    def overhead(self) -> float:
        return min(self.constrained_s) / min(self.free_s) - 1.0


def _decode_seconds(engine: Engine, prompt: list[int], tokens: int, constrained: bool) -> float:
    res = GenerationResult()
    for _ in generate(engine, prompt, Sampling.create(max_tokens=tokens, ignore_eos=not constrained), result=res,
                      constraint=json_schema_constraint(SCHEMA) if constrained else None):  # fmt: skip
        pass
    if len(res.tokens) != tokens:
        raise InputError(f"the {'constrained' if constrained else 'free'} arm decoded {len(res.tokens)} tokens, not {tokens}")
    return res.timings.decode_s


def check_options(tokens: int, runs: int) -> None:
    """InputError for tokens < 2 or runs < 1."""
    if tokens < 2 or runs < 1:
        raise InputError(f"--tokens must be at least 2 and --runs at least 1, got {tokens} and {runs}")


def bench_constraint(engine: Engine, tokens: int = 128, runs: int = 5, warn=None) -> ConstraintBench:
    """Interleaved runs of both arms (greedy, chat prompt, ``tokens`` decoded each); InputError for tokens < 2 or
    runs < 1. ``warn`` is told if another process keeps the CPU busy before the runs."""
    check_options(tokens, runs)
    prompt = build_prompt(engine, text=PROMPT, chat=True).token_ids
    engine.warm_up()
    _decode_seconds(engine, prompt, 4, True)  # builds llguidance's token trie outside the timed runs
    if warn is not None and (msg := busy_warning()):
        warn(msg)
    free, constrained = [], []
    for _ in range(runs):
        free.append(_decode_seconds(engine, prompt, tokens, False))
        constrained.append(_decode_seconds(engine, prompt, tokens, True))
    return ConstraintBench(tokens, free, constrained)

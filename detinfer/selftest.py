"""Determinism fingerprints: the bytes a run must reproduce, for comparing across threads, chunks and processes.

``python -m detinfer.selftest --threads N --chunk-size K`` prints one fingerprint as JSON, so invariances across
processes (thread counts, fresh processes, compile targets) are checked by comparing the output of separate runs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys

from .engine import Engine, set_threads
from .errors import DetinferError
from .generate import GenerationResult, generate
from .sampler import SamplingParams

DEFAULT_TEXT = (
    "Once upon a time, in a small village at the edge of a great forest, there lived a wise old woman who "
    "kept bees. Every morning she walked to the river, counted 17 stones, and sang to the water. "
    "One day a traveller asked her why. She smiled, pointed at the hives, and said: \"The bees taught me "
    "patience; the river taught me to listen. Sit, and I will tell you the rest.\""
)


def fingerprint(engine: Engine, tokens: list[int], *, chunk_size: int, gen_tokens: int = 8, seed: int = 7) -> dict:
    """sha256 of the logits at every prompt position and of the KV cache after the prompt, plus a seeded
    sampled continuation (token ids and logits digest chain) of ``gen_tokens`` tokens."""
    cache = engine.new_cache()
    logits = engine.forward(tokens, cache, all_logits=True, chunk_size=chunk_size)
    res = GenerationResult()
    params = SamplingParams.create(temperature=0.8, top_p=0.9, top_k=40, seed=seed)
    for _ in generate(engine, tokens, params, max_tokens=gen_tokens, ignore_eos=True, chunk_size=chunk_size, result=res):
        pass
    return {
        "prompt_logits_sha256": hashlib.sha256(logits.astype("<f4").tobytes()).hexdigest(),
        "prompt_kv_sha256": cache.digest(),
        "generated": res.tokens,
        "final_digest": res.digests[-1],
        "final_kv_sha256": res.kv_sha256,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--chunk-size", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--kv-type", default="f32")
    ap.add_argument("--text", default=DEFAULT_TEXT)
    args = ap.parse_args(argv)
    try:
        set_threads(args.threads)
        engine = Engine.load(args.model, n_ctx=args.ctx, kv_type=args.kv_type)
        tokens = engine.tokenizer.encode(args.text)
        print(json.dumps(fingerprint(engine, tokens, chunk_size=args.chunk_size), sort_keys=True))
    except DetinferError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())

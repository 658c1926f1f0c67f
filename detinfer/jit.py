"""numba's compile target for detinfer's kernels, set once before the first kernel compiles.

On a host with AVX-512, LLVM's tuning for recent Intel and AMD CPUs ("prefer-256-bit") keeps auto-vectorized
loops at 256 bits, half the width the host has. :func:`configure` turns that preference off, so the kernels'
row loops use 512-bit vectors (measured: about 20% faster decode and prefill matmuls on a 2-core Xeon with
AVX-512, docs/benchmarks.md). Bytes do not move: every kernel vectorizes across independent outputs, never
inside a sum, so the vector width changes how many outputs one instruction computes, not any output's order.

A user's own ``NUMBA_CPU_NAME`` or ``NUMBA_CPU_FEATURES`` always wins (that is how the benchmark compiles for
AVX2 only and how scripts/portability.py picks targets).
"""

from __future__ import annotations

import os

WIDE = "-prefer-256-bit"
WIDE_NOTE = " (512-bit vectors)"  # how machine records configure()'s target


def configure() -> None:
    """Let LLVM use 512-bit vectors on an AVX-512 host unless the user chose numba's target; a no-op elsewhere."""
    if "NUMBA_CPU_NAME" in os.environ or "NUMBA_CPU_FEATURES" in os.environ:
        return
    from numba.core import codegen, config

    features = codegen.get_host_cpu_features()
    if "+avx512f" in features.split(","):
        config.CPU_FEATURES = f"{features},{WIDE}"


def target_features_note(features: str | None) -> str:
    """How :mod:`detinfer.machine` shows numba's features: "" for the host's own, " (512-bit vectors)" for
    :func:`configure`'s, else the user's features string."""
    if features is None:
        return ""
    if features.endswith("," + WIDE):
        return WIDE_NOTE
    return f" features={features!r}"

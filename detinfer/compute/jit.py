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


# CPUs whose LLVM defaults include the instructions of an integer-dot tier (kernels._make_qblock); any other name
# falls back to plain LLVM IR, which every target compiles (slower, same bytes: the dots are exact integers).
_VNNI512_CPUS = {"cascadelake", "cooperlake", "icelake-client", "icelake-server", "tigerlake", "rocketlake",
                 "sapphirerapids", "emeraldrapids", "graniterapids", "graniterapids-d", "znver4", "znver5"}
_AVX512BW_CPUS = {"skylake-avx512", "cannonlake"}
_AVX2_CPUS = {"haswell", "broadwell", "skylake", "alderlake", "raptorlake", "meteorlake", "arrowlake", "znver1",
              "znver2", "znver3", "x86-64-v3", "x86-64-v4"}
TIERS = ("vnni512", "avx512bw", "avx2", "generic")


def int_dot_tier() -> str:
    """Which instructions the kernels' exact integer block dots compile to for numba's target (numba's
    ``CPU_NAME``/``CPU_FEATURES`` or the host's): "vnni512" (AVX512-VNNI vpdpbusd), "avx512bw" (vpmaddubsw +
    vpmaddwd), "avx2" (the same at 256 bits) or "generic" (plain IR). Speed only: every tier computes the same
    exact integers. A tier needs positive evidence (the CPU name's defaults or a "+feature"), and a "-feature"
    drops it, so the kernels never ask LLVM for an instruction its target lacks."""
    from llvmlite import binding as ll
    from numba.core import codegen, config

    name = config.CPU_NAME or ll.get_host_cpu_name()
    features = config.CPU_FEATURES if config.CPU_FEATURES is not None else codegen.get_host_cpu_features()
    flags = {f[1:]: f[0] == "+" for f in features.split(",") if f[:1] in "+-" and len(f) > 1}
    have = set()
    if name in _VNNI512_CPUS:
        have |= {"avx2", "avx512bw", "avx512vnni"}
    elif name in _AVX512BW_CPUS:
        have |= {"avx2", "avx512bw"}
    elif name in _AVX2_CPUS:
        have.add("avx2")
    have |= {f for f, on in flags.items() if on}
    implies = {"avx2": {"avx512f", "avx512bw", "avx512vnni"}, "avx512f": {"avx512bw", "avx512vnni"}}
    for f, on in flags.items():
        if not on:  # a feature turned off, and (as in LLVM) every feature that needs it
            have -= {f, *implies.get(f, ())}
    if {"avx512bw", "avx512vnni"} <= have and "avx2" in have:
        return "vnni512"
    if "avx512bw" in have and "avx2" in have:
        return "avx512bw"
    return "avx2" if "avx2" in have else "generic"

"""numba's compile target for detinfer's kernels, set once before the first kernel compiles.

On a host with AVX-512, LLVM's tuning for recent Intel and AMD CPUs ("prefer-256-bit") keeps auto-vectorized
loops at 256 bits, half the width the host has. :func:`configure` turns that preference off, so the kernels'
row loops use 512-bit vectors (measured: about 20% faster decode and prefill matmuls on a 2-core Xeon with
AVX-512, docs/benchmarks.md). Bytes do not move: every kernel vectorizes across independent outputs, never
inside a sum, so the vector width changes how many outputs one instruction computes, not any output's order.

A user's own ``NUMBA_CPU_NAME`` or ``NUMBA_CPU_FEATURES`` always wins (that is how the benchmark compiles for
AVX2 only and how scripts/portability.py picks targets).

``DETINFER_CPU_LEVEL`` (x86-64-v2, x86-64-v3 or x86-64-v4) compiles for an x86-64 micro-architecture level instead
of the host's CPU: numba keys its cache on the target, so kernels compiled once for a level (``detinfer warm-up``)
load on every CPU that has the level, e.g. the varied CPUs of CI runners sharing one restored cache. Same bytes.
"""

from __future__ import annotations

import os

from ..errors import InputError

WIDE = "-prefer-256-bit"
WIDE_NOTE = " (512-bit vectors)"  # how machine records configure()'s target
LEVEL_ENV = "DETINFER_CPU_LEVEL"
# x86-64 micro-architecture levels (the psABI's), highest first: the features each level adds to the one below
X86_LEVELS = (
    ("x86-64-v4", ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")),
    ("x86-64-v3", ("avx", "avx2", "bmi", "bmi2", "f16c", "fma", "lzcnt", "movbe")),
    ("x86-64-v2", ("cx16", "popcnt", "sse4.1", "sse4.2", "ssse3")),
)


def host_level() -> str:
    """The host's x86-64 level (x86-64-v1..v4) from LLVM's view of its features; on another architecture, the
    first part of LLVM's target triple (e.g. "aarch64")."""
    import llvmlite.binding as ll

    arch = ll.get_process_triple().split("-")[0]
    if arch != "x86_64":
        return arch
    features = {f[1:] for f in ll.get_host_cpu_features().flatten().split(",") if f.startswith("+")}
    names = [name for name, _ in X86_LEVELS]
    for i, name in enumerate(names):
        if all(set(need) <= features for _, need in X86_LEVELS[i:]):
            return name
    return "x86-64-v1"


def cpu_level() -> str | None:
    """The level ``DETINFER_CPU_LEVEL`` asks for (None when unset or empty). Raises InputError for a value that is
    not a level, a level this CPU lacks (its kernels would crash on an illegal instruction), or one set beside
    ``NUMBA_CPU_NAME`` / ``NUMBA_CPU_FEATURES`` (two targets)."""
    level = os.environ.get(LEVEL_ENV) or None
    if level is None:
        return None
    names = [name for name, _ in X86_LEVELS]
    if level not in names:
        raise InputError(f"{LEVEL_ENV}={level!r} is not a level; use one of {', '.join(reversed(names))}, or unset it for this CPU's own")
    if "NUMBA_CPU_NAME" in os.environ or "NUMBA_CPU_FEATURES" in os.environ:
        raise InputError(f"{LEVEL_ENV} and NUMBA_CPU_NAME/NUMBA_CPU_FEATURES both choose the compile target; unset one")
    host = host_level()
    if host not in names or names.index(host) > names.index(level):
        raise InputError(f"{LEVEL_ENV}={level}: this CPU is {host}, which lacks that level's instructions; use {host} or lower")
    return level


def check_target() -> None:
    """Raise InputError if ``DETINFER_CPU_LEVEL`` cannot be used (:func:`cpu_level`) or was set after
    :func:`configure` ran (when detinfer was imported): kernels would compile for another target than it names."""
    from numba.core import config

    level = cpu_level()
    if level is not None and config.CPU_NAME != level:
        raise InputError(f"{LEVEL_ENV}={level} was set after detinfer was imported; set it in the environment before")


def configure() -> None:
    """Compile for ``DETINFER_CPU_LEVEL`` when it is set (and valid: :func:`cpu_level` raises when a model loads);
    else let LLVM use 512-bit vectors on an AVX-512 host unless the user chose numba's target."""
    from numba.core import codegen, config

    try:
        level = cpu_level()
    except InputError:
        return  # left to Engine.load, which raises it: an import must not fail
    if level is not None:
        config.CPU_NAME, config.CPU_FEATURES = level, ""
        return
    if "NUMBA_CPU_NAME" in os.environ or "NUMBA_CPU_FEATURES" in os.environ:
        return
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
_AVX512BW_CPUS = {"skylake-avx512", "cannonlake", "x86-64-v4"}
_AVX2_CPUS = {"haswell", "broadwell", "skylake", "alderlake", "raptorlake", "meteorlake", "arrowlake", "znver1",
              "znver2", "znver3", "x86-64-v3"}
TIERS = ("vnni512", "avx512bw", "avx2", "generic")


def int_dot_tier() -> str:
    """Which instructions the kernels' exact integer block dots compile to for numba's target (numba's
    ``CPU_NAME``/``CPU_FEATURES`` or the host's): "vnni512" (AVX512-VNNI vpdpbusd), "avx512bw" (vpmaddubsw +
    vpmaddwd), "avx2" (the same at 256 bits) or "generic" (plain IR). Speed only: every tier computes the same
    exact integers. A tier needs positive evidence (the CPU name's defaults or a "+feature"), and a "-feature"
    drops it, so the kernels never ask LLVM for an instruction its target lacks."""
    from llvmlite import binding as ll
    from numba.core import codegen, config

    name = config.CPU_NAME if config.CPU_NAME is not None else ll.get_host_cpu_name()  # as numba's codegen picks it
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

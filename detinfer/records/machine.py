"""The machine a run was computed on, recorded in ``informative`` (never compared) so a cross-machine match is
visible in ``verify`` rather than assumed."""

from __future__ import annotations

import functools
import platform
import sys

from ..compute.jit import WIDE_NOTE, target_features_note
from .manifest import cpu_name

FEATURES = ("fma", "avx2", "avx512f", "neon", "asimd")  # the ISA features a compile target could use for floats


@functools.cache
def machine() -> dict[str, str]:
    """CPU model, numba's compile target (llvmlite's host CPU name unless NUMBA_CPU_NAME overrides it), the host's
    float-relevant ISA features, OS, libc and the versions of Python, numba, llvmlite and numpy; all strings."""
    import llvmlite
    import llvmlite.binding as llvm
    import numba
    import numpy as np

    host_features = {f[1:] for f in llvm.get_host_cpu_features().flatten().split(",") if f.startswith("+")}
    libc = " ".join(platform.libc_ver()).strip() or platform.system()
    name = numba.config.CPU_NAME  # numba hands LLVM an empty name as is: its generic CPU
    target = llvm.get_host_cpu_name() if name is None else name or "generic"
    return {
        "cpu": cpu_name(),
        "arch": platform.machine(),
        "host_cpu_name": llvm.get_host_cpu_name(),
        "compile_target": target + target_features_note(numba.config.CPU_FEATURES),
        "isa": ",".join(f for f in FEATURES if f in host_features),
        "os": f"{platform.system()} {platform.release()}",
        "libc": libc,
        "python": platform.python_version(),
        "numba": numba.__version__,
        "llvmlite": llvmlite.__version__,
        "numpy": np.__version__,
    }


def describe(m: dict[str, str] | None) -> str:
    """One line for ``verify``: "AMD EPYC 9B45 (znver5, target generic; fma,avx2,avx512f; Linux glibc 2.36; numba 0.68.1)"."""
    if not m:
        return "(not recorded)"
    target = m.get("compile_target", "")
    where = m.get("host_cpu_name", "") + (f", target {target}" if target and target != m.get("host_cpu_name") else "")
    return (f"{m.get('cpu', '?')} ({where}; {m.get('isa') or 'no fma/avx/neon'}; {m.get('os', '').split(' ')[0]} {m.get('libc', '')}; "
            f"numba {m.get('numba', '?')}, llvmlite {m.get('llvmlite', '?')}, numpy {m.get('numpy', '?')}, "
            f"python {m.get('python', '?')})")


def short(m: dict[str, str] | None) -> str:
    """A table cell: "znver3 x86_64", "rocketlake x86_64 -> generic", "generic aarch64"; "-" when not recorded.
    The host's own target with 512-bit vectors is the host's default build (detinfer.jit): no arrow."""
    if not m:
        return "-"
    target = m.get("compile_target", "").removesuffix(WIDE_NOTE)
    return f"{m.get('host_cpu_name', '?')} {m.get('arch', '')}" + (f" -> {target}" if target != m.get("host_cpu_name") else "")


if __name__ == "__main__":
    import json

    json.dump(machine(), sys.stdout, indent=2)
    print()

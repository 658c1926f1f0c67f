"""make portability's oldest-libraries target tests exactly pyproject.toml's lower bounds."""

import importlib.util
import re
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent


def test_pyproject_lower_bounds_are_the_tested_oldest_versions():
    spec = importlib.util.spec_from_file_location("portability", ROOT / "scripts" / "portability.py")
    portability = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(portability)
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    bounds = {m[1]: m[2] for d in deps if (m := re.match(r"([A-Za-z0-9_.-]+)>=([0-9.]+)", d))}
    assert {k: bounds[k] for k in portability.OLDEST} == portability.OLDEST


TIER_CASES = [
    ("cascadelake", "", "vnni512"),
    ("rocketlake", "-avx512vnni", "avx512bw"),  # a feature turned off drops its tier
    ("rocketlake", "-avx512f", "avx2"),  # ... and every tier that needs it
    ("skylake-avx512", "", "avx512bw"),
    ("haswell", "", "avx2"),
    ("haswell", "+avx512f,+avx512bw,+avx512vnni", "vnni512"),  # features given explicitly count
    ("znver3", "", "avx2"),
    ("generic", "", "generic"),
    ("", "", "generic"),  # NUMBA_CPU_NAME set but empty: numba hands LLVM "", its generic CPU, not the host's
    ("cortex-a72", "", "generic"),  # a CPU the table does not know: plain IR, which every target compiles
]


@pytest.mark.parametrize("cpu, features, tier", TIER_CASES)
def test_int_dot_tier_needs_positive_evidence(monkeypatch, cpu, features, tier):
    """The integer dots never ask LLVM for an instruction its target lacks (that would be a 'Cannot select'
    crash, not a wrong byte): the tier follows numba's CPU_NAME / CPU_FEATURES, conservatively."""
    from numba.core import config

    from detinfer.compute import jit

    monkeypatch.setattr(config, "CPU_NAME", cpu)
    monkeypatch.setattr(config, "CPU_FEATURES", features)
    assert jit.int_dot_tier() == tier

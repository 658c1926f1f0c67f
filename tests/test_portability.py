"""make portability's oldest-libraries target tests exactly pyproject.toml's lower bounds."""

import importlib.util
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_pyproject_lower_bounds_are_the_tested_oldest_versions():
    spec = importlib.util.spec_from_file_location("portability", ROOT / "scripts" / "portability.py")
    portability = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(portability)
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    bounds = {m[1]: m[2] for d in deps if (m := re.match(r"([A-Za-z0-9_.-]+)>=([0-9.]+)", d))}
    assert {k: bounds[k] for k in portability.OLDEST} == portability.OLDEST

"""Re-execute the committed manifests and golden records bit for bit on other compile targets, library versions
and CPU architectures (`make portability`; `make portability-full` runs every file on every target).

Targets, each in fresh processes with its own NUMBA_CACHE_DIR, one thread:
  generic    NUMBA_CPU_NAME=generic (x86-64 SSE2: no FMA, no AVX)
  haswell    NUMBA_CPU_NAME=haswell, NUMBA_CPU_FEATURES="" (AVX2 + FMA, no AVX-512)
  avx512     NUMBA_CPU_NAME=skylake-avx512, NUMBA_CPU_FEATURES="" (only where the host has AVX-512)
  host       numba's default: the host CPU with all its features
  oldest     numba/llvmlite/numpy at pyproject.toml's lower bounds (OLDEST), in a second venv
  aarch64    aarch64 Linux under qemu-user (scripts/aarch64-sysroot.sh), the venv's library versions
and a negative control that must FAIL: the host with DETINFER_BENCH_FASTMATH=1 (every kernel compiled with
fastmath, which reassociates sums and fuses multiply-adds) is detected as differing on at least one file.

The aarch64 target is emulated (slow) and runs in parallel with the x86-64 targets. Prints a markdown table;
exit 1 if any target mismatches (or the negative control matches), 2 if a target could not run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / ".portability"
VENV_PY = ROOT / ".venv" / "bin" / "python"
OLDEST = {"numba": "0.60.0", "llvmlite": "0.43.0", "numpy": "1.26.4"}  # pyproject.toml's lower bounds (tested)

# `make portability` (in CI): both models, greedy and seeded sampling and the f16 KV cache; the rest in --full
SUBSET = ["manifests/seeded_sampling.json", "manifests/f16_kv.json", "manifests/gemma3_seeded_sampling.json"]
AARCH64_SUBSET = ["manifests/seeded_sampling.json"]
FULL = ["manifests", "golden"]
CONTROL = ["manifests/plain_greedy.json", "manifests/seeded_sampling.json"]


def _host_has_avx512() -> bool:
    import llvmlite.binding as llvm

    return "+avx512f" in llvm.get_host_cpu_features().flatten().split(",")


def _verify(python: list[str], files: list[str], env: dict[str, str], cache: str) -> dict:
    """Run `detinfer verify --json` in a fresh process; (match, files, seconds, machine, messages)."""
    env = {**os.environ, "NUMBA_NUM_THREADS": "1", "NUMBA_CACHE_DIR": str(WORK / "cache" / cache), **env}
    t0 = time.perf_counter()
    proc = subprocess.run([*python, "-m", "detinfer.cli", "verify", "--json", "--threads", "1", *files],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    results = [r for r in rows if not r.get("summary")]
    return {
        "match": sum(r["status"] == "match" for r in results),
        "files": len(results),
        "seconds": time.perf_counter() - t0,
        "machine": next((r["reexecuted_on"] for r in results if r.get("reexecuted_on")), {}),
        "problems": [f"{r['path']}: {r['status']}: {r['message']}" for r in results if r["status"] != "match"]
        + ([proc.stderr.strip().splitlines()[-1]] if proc.returncode == 2 and proc.stderr.strip() else []),
        "exit": proc.returncode,
    }


def _oldest_venv() -> list[str]:
    """A second venv with OLDEST numba/llvmlite/numpy and this checkout (editable); returns its python."""
    venv = WORK / "venv-oldest"
    py = venv / "bin" / "python"
    stamp = venv / f".installed-{'-'.join(OLDEST.values())}"
    if not stamp.exists():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        pins = [f"{k}=={v}" for k, v in OLDEST.items()]
        subprocess.run([str(py), "-m", "pip", "install", "--quiet", *pins, "-e", str(ROOT)], check=True)
        stamp.touch()
    return [str(py)]


def _aarch64() -> tuple[list[str], dict[str, str]]:
    """qemu-user running arm64 Debian's python3.11 with aarch64 wheels (scripts/aarch64-sysroot.sh)."""
    base = WORK / "aarch64"
    subprocess.run(["bash", str(ROOT / "scripts" / "aarch64-sysroot.sh"), str(base)], cwd=ROOT, check=True,
                   env={**os.environ, "VENV_PY": str(VENV_PY)}, stdout=subprocess.DEVNULL)
    sysroot = base / "sysroot"
    python = ["qemu-aarch64-static", "-L", str(sysroot), str(sysroot / "usr" / "bin" / "python3.11")]
    return python, {"PYTHONPATH": f"{ROOT}:{base / 'site'}"}


def _row(name: str, what: str, r: dict, expect_match: bool = True) -> tuple[str, bool]:
    m = r["machine"]
    libs = f"numba {m.get('numba', '?')}, llvmlite {m.get('llvmlite', '?')}, numpy {m.get('numpy', '?')}"
    ok = (r["match"] == r["files"] > 0) if expect_match else (r["files"] > 0 and r["match"] < r["files"] and r["exit"] == 1)
    verdict = ("pass" if ok else "FAIL") + ("" if expect_match else " (must differ)")
    if not ok or not expect_match:
        for problem in r["problems"][:3]:
            print(f"{name}: {problem}", file=sys.stderr)
    line = (f"| {name} | {what} | {m.get('arch', '?')} | {m.get('compile_target', '?')} | {m.get('isa', '') or '-'} | {libs} "
            f"| {r['match']}/{r['files']} | {r['seconds']:.0f} s | {verdict} |")
    return line, ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="every manifest and golden record on every target")
    ap.add_argument("--targets", default="generic,haswell,avx512,host,oldest,aarch64,control")
    args = ap.parse_args()
    wanted = args.targets.split(",")
    files = FULL if args.full else SUBSET
    host = [str(VENV_PY)]
    x86 = [
        ("generic", "NUMBA_CPU_NAME=generic", {"NUMBA_CPU_NAME": "generic", "NUMBA_CPU_FEATURES": ""}),
        ("haswell", "NUMBA_CPU_NAME=haswell (no AVX-512)", {"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": ""}),
        ("avx512", "NUMBA_CPU_NAME=skylake-avx512", {"NUMBA_CPU_NAME": "skylake-avx512", "NUMBA_CPU_FEATURES": ""}),
        ("host", "host CPU, all features", {}),
    ]
    t0 = time.perf_counter()
    print("| target | how | arch | compile target | host ISA | libraries | match | time | result |")
    print("|---|---|---|---|---|---|---|---|---|", flush=True)

    rows: list[tuple[str, bool]] = []

    def add(row: tuple[str, bool]) -> None:  # printed as soon as its target is done
        print(row[0], flush=True)
        rows.append(row)

    with ThreadPoolExecutor(max_workers=1) as pool:
        emulated = None
        if "aarch64" in wanted:
            def run_aarch64() -> dict:
                python, env = _aarch64()
                return _verify(python, FULL if args.full else AARCH64_SUBSET, env, "aarch64")
            emulated = pool.submit(run_aarch64)
        for name, what, env in x86:
            if name not in wanted:
                continue
            if name == "avx512" and not _host_has_avx512():
                add((f"| {name} | {what} | x86_64 | - | - | - | - | - | skipped: the host has no AVX-512 |", True))
                continue
            add(_row(name, what, _verify(host, files, env, name)))
        if "oldest" in wanted:
            add(_row("oldest", "pyproject.toml's lower bounds, second venv", _verify(_oldest_venv(), files, {}, "oldest")))
        if "control" in wanted:
            r = _verify(host, CONTROL, {"DETINFER_BENCH_FASTMATH": "1"}, "fastmath")
            add(_row("control", "negative control: fastmath build", r, expect_match=False))
        if emulated is not None:
            try:
                add(_row("aarch64", "aarch64 Linux under qemu-user", emulated.result()))
            except subprocess.CalledProcessError as e:
                add((f"| aarch64 | qemu-user | - | - | - | - | - | - | FAIL: setup failed ({e}) |", False))
    print(f"\n{len(rows)} targets in {time.perf_counter() - t0:.0f} s")
    return 0 if all(ok for _, ok in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

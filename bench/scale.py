"""`make scale`: verify the committed manifests and run a 50-prompt batch without Ray, on 1 Ray actor x 2 threads
and on 2 actors x 1 thread (the CLI, end to end, in fresh processes), then measure Ray's overhead per item on a
running cluster. Prints the markdown table docs/scale.md shows and writes bench/scale.json.

Use an otherwise idle machine: numba's thread pools spin, so other load slows the 2-thread runs many-fold.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = (("no Ray, 2 threads", ["--threads", "2"]),
           ("Ray, 1 actor × 2 threads", ["--ray", "local", "--actors", "1", "--threads", "2"]),
           ("Ray, 2 actors × 1 thread", ["--ray", "local", "--actors", "2", "--threads", "1"]))
TOPICS = ("rivers", "bread", "clocks", "owls", "glass", "trains", "salt", "maps", "bees", "copper")


def batch_lines(n: int, max_tokens: int) -> list[dict]:
    """``n`` short greedy and seeded-sampling runs on the default model."""
    return [{"id": f"p{i:03d}", "prompt": f"Write one sentence about {TOPICS[i % len(TOPICS)]} (number {i}).",
             "chat": i % 2 == 0, "sampling": {"max_tokens": max_tokens, "temperature": 0.7 * (i % 3 == 0), "seed": i}}
            for i in range(n)]


def cli(*args: str) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "detinfer.cli", *args], cwd=ROOT, capture_output=True, text=True)
    return time.perf_counter() - t0, proc


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def end_to_end(verify: list[str], n: int, max_tokens: int) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        batch = Path(tmp) / "prompts.jsonl"
        batch.write_text("".join(json.dumps(line) + "\n" for line in batch_lines(n, max_tokens)))
        outputs = []
        for name, options in CONFIGS:
            load = loadavg()
            wall, proc = cli("verify", *verify, "--json", *options)
            lines = [json.loads(x) for x in proc.stdout.splitlines()]
            steps = sum(x.get("steps", 0) for x in lines[:-1])
            rows.append({"work": f"verify {' '.join(verify)}", "config": name, "exit": proc.returncode, "wall_s": round(wall, 1),
                         "tokens": steps, "tok_s": round(steps / wall, 1), "load_before": load})
            out = Path(tmp) / name.replace(" ", "_")
            load = loadavg()
            wall, proc = cli("batch", str(batch), "--out-dir", str(out), *options)
            files = {p.name: p.read_bytes() for p in sorted(out.glob("*.json"))}
            tokens = sum(len(json.loads(b)["output"]["token_ids"]) for b in files.values())
            rows.append({"work": f"batch of {n}", "config": name, "exit": proc.returncode, "wall_s": round(wall, 1),
                         "tokens": tokens, "tok_s": round(tokens / wall, 1), "load_before": load})
            outputs.append(files)
        assert all(o == outputs[0] for o in outputs), "batch manifests differ between configurations"
    return rows


def ray_overhead(n: int) -> dict:
    """On a running local cluster with 2 warm actors: per item, driver-observed latency (dispatch to result)
    minus the seconds the item ran inside its worker; and the cluster's start time."""
    sys.path.insert(0, str(ROOT))
    from detinfer.integrations.batch import (
        BatchItem,
        BatchLine,
        batch_failed,
        batch_task,
    )
    from detinfer.integrations.distributed import connect, run_on_ray

    items = [BatchItem(i + 1, line["id"], BatchLine.model_validate(line), None) for i, line in enumerate(batch_lines(n, 1))]
    t0 = time.perf_counter()
    with connect("local"):
        start_s = time.perf_counter() - t0
        sent: dict[int, float] = {}
        latency: dict[int, float] = {}

        def done(i, r):
            latency[i] = time.perf_counter() - sent[i] - r.seconds

        t1 = time.perf_counter()
        run_on_ray(batch_task, items, done, batch_failed, address="local", actors=2, threads=1,
                   on_dispatch=lambda i, pid: sent.__setitem__(i, time.perf_counter()))
        wall = time.perf_counter() - t1
    warm = [latency[i] for i in sorted(latency)[2:]]  # the first item of each actor also loads its model
    return {"cluster_start_s": round(start_s, 2), "actor_run_wall_s": round(wall, 2), "items": n,
            "overhead_ms_per_item_median": round(1000 * statistics.median(warm), 1),
            "overhead_ms_per_item_max": round(1000 * max(warm), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--verify", nargs="+", default=["manifests"], help="what to verify (default: manifests)")
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "scale.json")
    args = ap.parse_args()
    report = {"cpu_count": os.cpu_count(), "load_at_start": loadavg(), "rows": end_to_end(args.verify, args.prompts, args.max_tokens),
              "ray_overhead": ray_overhead(args.prompts), "load_at_end": loadavg()}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print("| work | configuration | wall (s) | tokens | tok/s | exit | load avg before |")
    print("|---|---|---|---|---|---|---|")
    for r in report["rows"]:
        print(f"| {r['work']} | {r['config']} | {r['wall_s']} | {r['tokens']} | {r['tok_s']} | {r['exit']} | {r['load_before']} |")
    o = report["ray_overhead"]
    print(f"\nRay: local cluster start {o['cluster_start_s']} s; per item (dispatch to result minus time in the worker, "
          f"{o['items']} one-token items on 2 warm actors): median {o['overhead_ms_per_item_median']} ms, max {o['overhead_ms_per_item_max']} ms")
    print(f"load average: {report['load_at_start']} at start, {report['load_at_end']} at end ({report['cpu_count']} cores)")


if __name__ == "__main__":
    main()

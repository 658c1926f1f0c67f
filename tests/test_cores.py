"""A cgroup CPU quota (a container's --cpus, a Kubernetes CPU limit) sizes numba's thread pool (compute/cores.py):
the quota is read along the process's cgroup path in either cgroup version, and a process started in a cgroup
with a 1-CPU quota runs a pool of 1 on a machine of more cores, while one outside it (the control) and one whose
user set NUMBA_NUM_THREADS keep theirs."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from detinfer.compute import cores

V2_MOUNT = "30 23 0:26 {root} {point} rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate"
V1_CPU_MOUNT = "35 25 0:31 {root} {point} rw,nosuid,nodev,noexec,relatime shared:9 - cgroup cgroup rw,cpu"
V1_OTHER_MOUNT = "36 25 0:32 / {point} rw,nosuid,nodev,noexec,relatime shared:10 - cgroup cgroup rw,memory"
PROBE = "import detinfer, numba; print(numba.config.NUMBA_NUM_THREADS)"


def _proc(tmp_path: Path, mounts: list[str], cgroup: list[str], files: dict[str, str]) -> Path:
    """A /proc/self of these mountinfo lines and cgroup lines ({tmp} is tmp_path), with these cgroup files."""
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "mountinfo").write_text("".join(m.format(tmp=tmp_path) + "\n" for m in mounts))
    (proc / "cgroup").write_text("".join(c + "\n" for c in cgroup))
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return proc


@pytest.mark.parametrize("mounts, cgroup, files, expected", [
    # v2: the smallest quota along the path counts; "max" is none
    ([V2_MOUNT.format(root="/", point="{tmp}/cg")], ["0::/a/b"],
     {"cg/a/cpu.max": "150000 100000\n", "cg/a/b/cpu.max": "max 100000\n"}, 1.5),
    ([V2_MOUNT.format(root="/", point="{tmp}/cg")], ["0::/a/b"],
     {"cg/a/cpu.max": "400000 100000\n", "cg/a/b/cpu.max": "200000 100000\n"}, 2.0),
    ([V2_MOUNT.format(root="/", point="{tmp}/cg")], ["0::/a"], {"cg/a/cpu.max": "max 100000\n"}, None),
    # a container's namespace: the mount's root is the process's own cgroup
    ([V2_MOUNT.format(root="/kubepods/pod1/c1", point="{tmp}/cg")], ["0::/kubepods/pod1/c1"],
     {"cg/cpu.max": "50000 100000\n"}, 0.5),
    # hybrid: the cpu controller on v1 wins over a v2 mount without it; -1 is no quota
    ([V2_MOUNT.format(root="/", point="{tmp}/unified"), V1_OTHER_MOUNT.format(point="{tmp}/memory"),
      V1_CPU_MOUNT.format(root="/", point="{tmp}/cpu")], ["4:memory:/x", "1:cpu:/detq", "0::/"],
     {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n",
      "cpu/detq/cpu.cfs_quota_us": "100000\n", "cpu/detq/cpu.cfs_period_us": "100000\n"}, 1.0),
    ([V1_CPU_MOUNT.format(root="/", point="{tmp}/cpu")], ["1:cpu:/detq"],
     {"cpu/detq/cpu.cfs_quota_us": "-1\n", "cpu/detq/cpu.cfs_period_us": "100000\n"}, None),
    ([V1_OTHER_MOUNT.format(point="{tmp}/memory")], ["4:memory:/"], {}, None),  # no cpu controller mounted
    ([V2_MOUNT.format(root="/", point="{tmp}/cg")], ["0::/a"], {"cg/a/cpu.max": "a lot\n"}, None),  # unreadable
], ids=["v2-parent", "v2-leaf", "v2-none", "v2-namespace", "v1-hybrid", "v1-none", "no-cpu-mount", "v2-garbage"])  # fmt: skip
def test_the_quota_is_the_smallest_along_the_cgroup_path(tmp_path, mounts, cgroup, files, expected):
    proc = _proc(tmp_path, mounts, cgroup, files)
    assert cores.quota_cpus(proc) == expected
    affinity = len(os.sched_getaffinity(0))
    assert cores.usable_cores(proc) == (affinity if expected is None else max(1, min(affinity, int(expected))))


def _cpu_cgroup() -> tuple[Path, str] | None:
    """A folder under which this (root) process may make a cgroup with a CPU quota, and the quota file's format."""
    v1 = Path("/sys/fs/cgroup/cpu")
    if (v1 / "cpu.cfs_quota_us").is_file() and os.access(v1, os.W_OK):
        return v1, "v1"
    v2 = Path("/sys/fs/cgroup")
    try:
        if "cpu" in (v2 / "cgroup.subtree_control").read_text().split() and os.access(v2, os.W_OK):
            return v2, "v2"
    except OSError:
        pass
    return None


def test_a_process_under_a_one_cpu_quota_runs_a_pool_of_one():
    """Measured before the cap: on 2 cores under a 1-CPU quota SmolLM2 decoded at 91 tok/s with numba's default 2
    threads, 169 at 1 (the spinning second thread spent the quota and the process was throttled)."""
    found = _cpu_cgroup()
    if found is None or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs a writable cgroup cpu controller (root) and at least 2 cores")
    base, version = found
    cg = base / f"detinfer-test-{uuid.uuid4().hex[:8]}"
    cg.mkdir()
    try:
        if version == "v1":
            (cg / "cpu.cfs_period_us").write_text("100000")
            (cg / "cpu.cfs_quota_us").write_text("100000")
        else:
            (cg / "cpu.max").write_text("100000 100000")

        def pool(inside: bool, **env: str) -> str:
            enter = f"echo $$ > {cg / 'cgroup.procs'}; " if inside else ""
            full = {k: v for k, v in os.environ.items() if k != "NUMBA_NUM_THREADS"} | env
            r = subprocess.run(["sh", "-c", f'{enter}exec "$0" -c "$1"', sys.executable, PROBE], env=full, capture_output=True,
                               text=True, timeout=120)  # fmt: skip
            assert r.returncode == 0, r.stderr
            return r.stdout.strip()

        assert pool(True) == "1"
        assert pool(False) == str(len(os.sched_getaffinity(0)))  # control: no quota, every core of the mask
        assert pool(True, NUMBA_NUM_THREADS="2") == "2"  # the user's own setting wins
    finally:
        cg.rmdir()

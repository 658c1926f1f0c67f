"""How many cores this process may use: its CPU affinity, capped by a cgroup CPU quota.

A container's ``--cpus`` and a Kubernetes CPU limit are a quota (CFS bandwidth: so much CPU time per period), not
fewer visible cores, so numba's default pool (one thread per core of the affinity mask) outnumbers what the process
may run. numba's parallel regions end at a barrier where threads spin, so one thread beyond the quota spends it
spinning and the whole process is throttled until the next period: on 2 cores under a 1-CPU quota, SmolLM2 decoded
at 91 tok/s with its default 2 threads against 169 at 1 (measured). :func:`cap_numba_threads` sizes numba's pool to
the quota, rounded down, before numba starts it; a user's ``NUMBA_NUM_THREADS`` always wins.

The quota is the smallest of the process's cgroup and its ancestors up to the mount (cgroup v2 ``cpu.max``; v1
``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` of the ``cpu`` controller), found through /proc/self/cgroup and
/proc/self/mountinfo (the kernel's Documentation/admin-guide/cgroup-v2.rst and cgroup-v1/cgroups.rst).
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

PROC = Path("/proc/self")
quota_capped: float | None = None  # the quota (CPUs) cap_numba_threads sized numba's pool to, if it did


def _cpu_mount(proc: Path) -> tuple[int, str, str] | None:
    """(cgroup version, root of the mount in the hierarchy, mount point) of the cgroup that holds the ``cpu``
    controller: v1's ``cpu`` hierarchy where there is one (a hybrid layout keeps the controllers there), else v2's."""
    found = {}
    for line in (proc / "mountinfo").read_text().splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        tail = fields[fields.index("-") + 1 :]
        if len(tail) < 3:
            continue
        if tail[0] == "cgroup" and "cpu" in tail[2].split(","):
            found[1] = (1, fields[3], fields[4])
        elif tail[0] == "cgroup2":
            found.setdefault(2, (2, fields[3], fields[4]))
    return found.get(1) or found.get(2)


def _own_path(proc: Path, version: int) -> str | None:
    """This process's cgroup path in that hierarchy, from /proc/self/cgroup ("0::/path" for v2, "N:cpu,...:/path")."""
    for line in (proc / "cgroup").read_text().splitlines():
        hid, controllers, path = line.split(":", 2)
        if (version == 2 and hid == "0" and controllers == "") or (version == 1 and "cpu" in controllers.split(",")):
            return path
    return None


def _quota(folder: Path, version: int) -> float | None:
    """CPUs' worth of quota set in one cgroup folder, or None for none (or a file that is absent or unreadable)."""
    try:
        if version == 2:
            quota, period = (folder / "cpu.max").read_text().split()
        else:
            quota, period = (folder / "cpu.cfs_quota_us").read_text(), (folder / "cpu.cfs_period_us").read_text()
        if quota.strip() in ("max", "-1") or int(period) <= 0:
            return None
        return int(quota) / int(period)
    except (OSError, ValueError):
        return None


def quota_cpus(proc: Path = PROC) -> float | None:
    """The CPU quota of this process in CPUs (e.g. 1.5), the smallest along its cgroup's path to the mount, or None
    where no quota is set or the files cannot be read (not Linux, no cgroup mounted)."""
    try:
        mount = _cpu_mount(proc)
        if mount is None:
            return None
        version, root, point = mount
        path = _own_path(proc, version)
    except (OSError, ValueError):
        return None
    if path is None:
        return None
    if root == "/":
        rel = path
    elif path == root or path.startswith(root + "/"):
        rel = path[len(root) :]
    else:  # the mount shows another part of the hierarchy (a namespace's): its point is the nearest we can read
        rel = ""
    folder, top = Path(point + rel.rstrip("/")), Path(point)
    quotas = []
    while True:
        if (q := _quota(folder, version)) is not None:
            quotas.append(q)
        if folder == top or top not in folder.parents:
            break
        folder = folder.parent
    return min(quotas) if quotas else None


def usable_cores(proc: Path = PROC) -> int:
    """The cores this process may keep busy: its affinity mask's count, capped by :func:`quota_cpus` rounded down,
    at least 1."""
    return _capped(quota_cpus(proc), _affinity())


def _capped(quota: float | None, affinity: int) -> int:
    return affinity if quota is None else max(1, min(affinity, math.floor(quota)))


def _affinity() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cap_numba_threads() -> None:
    """Set ``NUMBA_NUM_THREADS`` to :func:`usable_cores` when a quota caps it below numba's default and the user has
    not set it, before numba's pool starts (child processes, the compile helper's, inherit it). A pool already
    started is left alone: numba refuses a new size then."""
    if "NUMBA_NUM_THREADS" in os.environ:
        return
    parallel = sys.modules.get("numba.np.ufunc.parallel")
    if parallel is not None and parallel._is_initialized:
        return
    global quota_capped
    quota, affinity = quota_cpus(), _affinity()  # read once: this runs at every import of detinfer
    if (n := _capped(quota, affinity)) < affinity:
        quota_capped = quota
        os.environ["NUMBA_NUM_THREADS"] = str(n)
        if (config := sys.modules.get("numba.core.config")) is not None:
            config.reload_config()

"""This machine's memory bandwidth, the yardstick of the 1B-class decode figures in ``detinfer bench``: a decoded
token streams every weight matrix once, so weight bytes × tok/s against the read bandwidth says how close decode
runs to the memory.

Read: the faster of ``a.sum()`` and ``a.max()`` over a float64 array of ``array_bytes`` (default 1 GiB, far beyond any
cache), per run. Either reader alone can be the slower part: on a 2-core Xeon (Emerald Rapids, 2026-12-06) sum read
the 1 GiB array at 11.7 GB/s and max at 18.8 (a 1 MiB array: 45 and 87 GB/s), so sum alone made decode look faster
than memory (weights streamed at 155% of the "read bandwidth"). Copy: ``np.copyto`` of the same
array into a second one, counted as bytes read + bytes written. At n threads the arrays are split into n contiguous
parts, each handled by its own Python thread (numpy releases the GIL in both operations).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .report import BandwidthRun, stats

ARRAY_BYTES = 1 << 30
RUNS = 5
READERS: tuple[Callable[[np.ndarray], object], ...] = (np.sum, np.max)


def _timed(pool: ThreadPoolExecutor, op: Callable[[int], object], parts: int) -> float:
    t0 = time.perf_counter()
    list(pool.map(op, range(parts)))
    return time.perf_counter() - t0


def measure_bandwidth(threads: Sequence[int], array_bytes: int = ARRAY_BYTES, runs: int = RUNS) -> list[BandwidthRun]:
    """Read and copy GB/s (1e9 bytes/s) at each thread count, ``runs`` times each (thread counts alternate run by
    run). ``array_bytes`` is rounded down to whole float64 elements; raises ValueError if that is fewer than one per
    thread."""
    n = array_bytes // 8
    if n < max(threads):
        raise ValueError(f"array of {array_bytes} bytes is too small for {max(threads)} threads")
    src, dst = np.ones(n), np.empty(n)  # ones: every page touched before timing
    dst.fill(0.0)
    read: dict[int, list[float]] = {t: [] for t in threads}
    copy: dict[int, list[float]] = {t: [] for t in threads}
    for _ in range(runs):
        for t in threads:
            bounds = np.linspace(0, n, t + 1).astype(np.int64)
            part = lambda i, a: a[bounds[i] : bounds[i + 1]]  # noqa: E731
            with ThreadPoolExecutor(t) as pool:
                read[t].append(max(src.nbytes / _timed(pool, lambda i: reader(part(i, src)), t) / 1e9 for reader in READERS))
                copy[t].append(2 * src.nbytes / _timed(pool, lambda i: np.copyto(part(i, dst), part(i, src)), t) / 1e9)
    return [BandwidthRun(threads=t, array_bytes=src.nbytes, read_gb_s=stats(read[t]), copy_gb_s=stats(copy[t])) for t in threads]

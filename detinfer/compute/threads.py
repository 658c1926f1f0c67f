"""How many threads a forward pass uses: a fixed count, or (the default) as many as the machine has free now.

numba's parallel regions split their work into one fixed share per thread and end at a barrier, hundreds of times
per token. On a core that another process keeps busy, the thread of that share runs only when the scheduler gives
it a slice, and every region waits for it: two threads beside one busy loop decode several times slower than one
(measured in docs/benchmarks.md). So by default the count follows what other processes leave free, read from the
kernel's accounting: over each window of WINDOW_S seconds, the machine's busy CPU time (/proc/stat) minus this
process's own (its spinning threads included) is the load of everyone else; the count is the number of cores
that load leaves, rounded down (a core more than three-quarters free counts), at least 1, at most the cores numba
started with. A pause of this thread between forward passes ends a window uncounted: another process that ran
while this one waited (for the next request; for its turn in a benchmark) took no core from it, and counting it
made each of two detinfer processes taking turns on an idle machine run at 1 thread. The count a pass after a
pause starts with is chosen from what runs at that instant instead (/proc/loadavg's runnable threads less this
process's own), not kept from before the pause: a busy loop that started while a server waited for a request, or
a benchmark's next cell, made the whole first prefill run on a taken core. A process's first count is chosen the
same way (it was a 50 ms window of accounting: a twentieth of a warm start). The count never changes a
result (kernels parallelise over independent outputs only); it is chosen per calling thread, as numba's count
is. Where /proc/stat cannot be read, all cores are used.

One thread of a process runs passes at more than one thread (:func:`forward_pass`): numba's OpenMP layer gives each
thread that runs a parallel kernel a pool of its own, and with more pool threads than cores libgomp stops
spinning between parallel regions, so each region waits for a futex wake-up (on 2 cores, 2-thread passes on a
second thread ran 3.3x slower than 1 thread). The first thread to run such a pass keeps them while it lives; the
default count of any other thread is 1 meanwhile, and a fixed count there is kept with one warning.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numba

from ..errors import InputError
from . import cores

WINDOW_S = 0.2  # seconds of accounting per choice: a few hundred decode steps' worth of parallel regions
STALE_S = 1.0  # a window this old spans a pause of this thread: others' load then says nothing of now; start anew
FREE_FRACTION = 0.75  # a core whose other load is below a quarter of it counts as free
PAUSE_S = 0.1  # this long between two forward passes of a thread (longer than any step's sampling) is a pause
RESAMPLE_S = 0.012  # after a pause that ends beside runnable threads, when to count them again (libgomp's spin: ~10 ms)
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

# per calling thread: auto (bool), window start (time, machine busy s, own cpu s), end of its last forward pass
_local = threading.local()
_last_choice: int | None = None  # the last automatic count of any thread: where a new one starts
_pool_owner: threading.Thread | None = None  # the thread whose passes run at more than 1 thread (module docstring)
_pool_warned = False
_log = logging.getLogger("detinfer.threads")


def _machine_busy_s() -> float | None:
    """Busy CPU seconds of the whole machine since boot (all cores: user, nice, system, irq, softirq, steal), or
    None where /proc/stat cannot be read. Steal counts as busy: on a VM it is time the core was not ours."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != b"cpu":
        return None
    values = [int(v) for v in fields[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = values + [0] * (8 - len(values))
    return (user + nice + system + irq + softirq + steal) / _CLK_TCK


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def _runnable_others() -> int | None:
    """Threads of other processes runnable at this instant: the running count of /proc/loadavg (runnable tasks,
    this thread included) less this process's threads in state R, or None where either cannot be read."""
    try:
        with open("/proc/loadavg", "rb") as f:
            running = int(f.read().split()[3].split(b"/")[0])
        own = 0
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                    own += f.read().rsplit(b")", 1)[1].split()[0] == b"R"
            except OSError:  # a thread that ended meanwhile
                pass
    except (OSError, ValueError, IndexError):
        return None
    return max(0, running - max(own, 1))


def _runnable_now() -> int | None:
    """:func:`_runnable_others`, read again after RESAMPLE_S when it is not 0 (the fewer of the two): a busy
    process is runnable in both reads; a process that has just stopped (another detinfer taking turns with this
    one: its OpenMP threads spin for ~5-10 ms after their last region) is not in the second."""
    n = _runnable_others()
    if n:
        time.sleep(RESAMPLE_S)
        again = _runnable_others()
        n = None if again is None else min(n, again)
    return n


def _count_after_pause() -> int | None:
    """The count for a first pass (of the process, or after a pause): the cores the threads of other processes
    runnable now leave free, at least 1 (None where /proc cannot tell)."""
    others = _runnable_now()
    return None if others is None else max(1, numba.config.NUMBA_NUM_THREADS - others)


def free_cores(busy_others_s: float, window_s: float, n_cores: int) -> int:
    """The thread count for a window in which other processes used ``busy_others_s`` CPU seconds over
    ``window_s`` seconds of a machine of ``n_cores`` cores: the cores their load leaves free (at least 1)."""
    others = max(0.0, busy_others_s) / window_s
    return max(1, min(n_cores, int(n_cores - others + (1 - FREE_FRACTION))))


def set_threads(threads: int | None) -> int:
    """Use ``threads`` threads in this calling thread's forward passes, or with None as many as are free (see the
    module docstring; re-chosen every WINDOW_S seconds by :func:`adapt_threads`). Never changes a result, only
    speed. Returns the count in effect now.

    Raises InputError if ``threads`` is not between 1 and the number of cores numba was started with.
    """
    global _last_choice
    limit = numba.config.NUMBA_NUM_THREADS
    if threads is not None:
        n = int(threads)
        if not 1 <= n <= limit:
            q = cores.quota_capped
            why = (f"the process's CPU quota, a container's --cpus or a Kubernetes CPU limit, is {q:g} CPU{'s' * (q != 1)}; "
                   "NUMBA_NUM_THREADS=N overrides it") if q is not None else "NUMBA_NUM_THREADS caps it"  # fmt: skip
            raise InputError(f"--threads {threads} is out of range; use 1..{limit} ({why})")
        _local.auto = False
        numba.set_num_threads(n)
        return n
    _local.auto = limit > 1 and _machine_busy_s() is not None
    _local.window = None
    if _local.auto and _last_choice is None:  # the process's first choice: like a pass after a pause
        _last_choice = _count_after_pause()
    n = _last_choice if _local.auto and _last_choice is not None else limit
    numba.set_num_threads(n)
    return n


def adapt_threads() -> None:
    """With automatic threads, close the accounting window once WINDOW_S seconds have passed and set the count for
    the next one (a window older than STALE_S, which spans a pause of this thread, only starts a new one;
    :func:`forward_pass` drops one that spans a shorter pause). Costs a clock read between windows."""
    global _last_choice
    if not getattr(_local, "auto", False):
        return
    now = time.monotonic()
    window = getattr(_local, "window", None)
    if window is not None and now - window[0] < WINDOW_S:
        return
    busy = _machine_busy_s()
    own = _own_cpu_s()
    if busy is None:
        return
    if window is not None and now - window[0] <= STALE_S:
        t0, busy0, own0 = window
        n = free_cores((busy - busy0) - (own - own0), now - t0, numba.config.NUMBA_NUM_THREADS)
        if n != numba.get_num_threads():
            numba.set_num_threads(n)
        _last_choice = n
    _local.window = (time.monotonic(), busy, own)


@contextmanager
def forward_pass() -> Iterator[None]:
    """Around each forward chunk: :func:`adapt_threads` before it. If this thread paused for more than PAUSE_S
    since its last pass, the window is dropped (what ran meanwhile did not compete with it) and, with automatic
    threads, the count is what the threads runnable now leave free (:func:`_runnable_now`)."""
    global _last_choice
    if time.monotonic() - getattr(_local, "last_end", math.inf) > PAUSE_S:
        _local.window = None
        if getattr(_local, "auto", False) and (n := _count_after_pause()) is not None:
            _last_choice = n
            numba.set_num_threads(n)
    adapt_threads()
    if numba.get_num_threads() > 1:
        _one_pool()
    try:
        yield
    finally:
        _local.last_end = time.monotonic()


def _one_pool() -> None:
    """Before a pass at more than 1 thread: claim the OpenMP pool for this thread, or, while another live thread
    holds it, run an automatic count at 1 (see the module docstring); warn once either way."""
    global _pool_owner, _pool_warned
    me = threading.current_thread()
    if _pool_owner is None or _pool_owner is me or not _pool_owner.is_alive():
        _pool_owner = me
        return
    auto = getattr(_local, "auto", False)
    if auto:
        numba.set_num_threads(1)
    if not _pool_warned:
        _pool_warned = True
        _log.warning("forward passes on thread %r while %r runs them at more than 1 thread: numba gives each thread its "
                     "own pool, and two run many times slower; %s (run every pass of a process on one thread)",
                     me.name, _pool_owner.name, "this thread uses 1" if auto else "a fixed count here is slow")


@contextmanager
def fixed_threads(threads: int) -> Iterator[None]:
    """Use exactly ``threads`` threads in this calling thread inside the block (no automatic choice can change it
    mid-way), then give back the choice before it: the same fixed count, or automatic again.

    Raises InputError as :func:`set_threads` does.
    """
    auto, before = getattr(_local, "auto", False), numba.get_num_threads()
    set_threads(threads)
    try:
        yield
    finally:
        numba.set_num_threads(before)
        _local.auto, _local.window = auto, None

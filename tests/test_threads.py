"""The default thread count follows the cores other processes leave free (compute/threads.py), and never moves a
byte: a busy loop on one core makes it drop to the free cores, an explicit count stays as given (the control), and
the logits of a run whose count changes between chunks equal a 1-thread run's."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import numba
import numpy as np
import pytest

from detinfer.compute import threads
from detinfer.compute.engine import Engine, set_threads
from detinfer.compute.threads import fixed_threads


@pytest.mark.parametrize("others, cores, expected", [
    (0.0, 2, 2), (0.2, 2, 2), (0.3, 2, 1), (1.0, 2, 1), (3.0, 2, 1), (-0.5, 2, 2), (1.0, 4, 3), (0.0, 1, 1),
])  # fmt: skip
def test_free_cores(others, cores, expected):
    """Other processes' load in cores over a 1 s window -> the thread count: a core counts as free while less than
    a quarter of it is taken."""
    assert threads.free_cores(others, 1.0, cores) == expected


@pytest.fixture(scope="module")
def engine(model_path):
    return Engine.load(model_path, n_ctx=256)


def _forward(engine: Engine, ids: list[int], seconds: float) -> np.ndarray:
    """Forward ``ids`` again and again (a fresh cache each time) for at least ``seconds``; the last logits."""
    t_end = time.monotonic() + seconds
    while True:
        logits = engine.forward(ids, engine.new_cache(), all_logits=True, chunk_size=8)
        if time.monotonic() >= t_end:
            return logits


def test_a_busy_core_lowers_the_default_count_and_no_byte_moves(engine, monkeypatch):
    limit = numba.config.NUMBA_NUM_THREADS
    if limit < 2:
        pytest.skip("one core: there is no count to choose")
    ids = engine.tokenizer.encode("The capital of France is Paris, and the capital of Italy is Rome.")
    set_threads(1)
    reference = engine.forward(ids, engine.new_cache(), all_logits=True, chunk_size=8)
    loop = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        set_threads(None)
        with fixed_threads(limit):  # the control: a fixed count is kept whatever the load
            _forward(engine, ids, 3 * threads.WINDOW_S)
            assert numba.get_num_threads() == limit
        logits = _forward(engine, ids, 4 * threads.WINDOW_S)
        assert numba.get_num_threads() == limit - 1
        assert logits.tobytes() == reference.tobytes()
        monkeypatch.setattr(threads, "WINDOW_S", 0.0)  # a new choice before every chunk: counts change mid-run
        assert _forward(engine, ids, 0.5).tobytes() == reference.tobytes()
    finally:
        loop.kill()
        loop.wait()
        set_threads(None)


@pytest.mark.parametrize("pause_s, expected", [(threads.PAUSE_S, 0), (float("inf"), -1)])
def test_a_process_that_ran_while_this_one_paused_takes_no_core(engine, monkeypatch, pause_s, expected):
    """Another process busy only while this one waits between forward passes (for the next request; for its turn
    in a benchmark) leaves the count at every core. The control (no pause ends a window, as before) drops to one
    thread fewer: two detinfer processes taking turns on an idle machine each ran at 1 thread."""
    limit = numba.config.NUMBA_NUM_THREADS
    if limit < 2:
        pytest.skip("one core: there is no count to choose")
    monkeypatch.setattr(threads, "PAUSE_S", pause_s)
    monkeypatch.setattr(threads, "STALE_S", 10.0)  # only the pause rule may end the window, however slow the runner
    ids = engine.tokenizer.encode("The capital of France is Paris.")
    set_threads(None)
    try:
        _forward(engine, ids, 2 * threads.WINDOW_S)
        assert numba.get_num_threads() == limit, "an idle machine: every core"
        loop = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        time.sleep(0.6)  # this thread's pause: the window spans it
        loop.kill()
        loop.wait()
        engine.forward(ids, engine.new_cache())  # its first chunk closes the window
        assert numba.get_num_threads() == limit + expected
    finally:
        set_threads(None)


@pytest.mark.parametrize("busy", [True, False])
def test_a_pass_after_a_pause_starts_from_what_runs_now(engine, busy):
    """After a pause the count comes from what runs at that instant: a busy loop that started while this thread
    waited takes its core from the first pass on. Before, the count from before the pause ran that whole pass (a
    server's first request, a benchmark's next cell: make bench-busy's first busy prefill ran at 0.5x). Control:
    nothing started, so every core."""
    limit = numba.config.NUMBA_NUM_THREADS
    if limit < 2:
        pytest.skip("one core: there is no count to choose")
    ids = engine.tokenizer.encode("The capital of France is Paris.")
    set_threads(None)
    loop = None
    try:
        _forward(engine, ids, 2 * threads.WINDOW_S)
        assert numba.get_num_threads() == limit, "an idle machine: every core"
        loop = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
        time.sleep(0.6)  # this thread's pause; one short pass after it closes no window, so its count stays
        engine.forward(ids, engine.new_cache())
        assert numba.get_num_threads() == (limit - 1 if busy else limit)
    finally:
        if loop is not None:
            loop.kill()
            loop.wait()
        set_threads(None)


@pytest.mark.parametrize("resample_s, expected", [(0.1, 0), (0.0, -1)])
def test_a_process_that_stops_as_this_one_starts_takes_no_core(engine, monkeypatch, resample_s, expected):
    """Another detinfer taking turns with this one is still runnable for a few ms after its turn (its OpenMP
    threads spin ~10 ms): the runnable threads are counted again RESAMPLE_S later, and a process that has stopped
    by then takes no core. Control: read again at once, it is still running and takes one."""
    limit = numba.config.NUMBA_NUM_THREADS
    if limit < 2:
        pytest.skip("one core: there is no count to choose")
    monkeypatch.setattr(threads, "RESAMPLE_S", resample_s)
    ids = engine.tokenizer.encode("The capital of France is Paris.")
    set_threads(None)
    spin = "import sys, time\nprint(flush=True)\nend = time.monotonic() + 0.5\nwhile time.monotonic() < end: pass\ntime.sleep(60)"
    _forward(engine, ids, 2 * threads.WINDOW_S)
    peer = subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE)
    try:
        peer.stdout.readline()  # it spins from now for 0.5 s, then sleeps
        time.sleep(0.46)  # this thread's pause ends 40 ms before the peer stops
        engine.forward(ids, engine.new_cache())
        assert numba.get_num_threads() == limit + expected
    finally:
        peer.kill()
        peer.wait()
        set_threads(None)


def test_without_proc_stat_the_default_is_every_core(monkeypatch):
    monkeypatch.setattr(threads, "_machine_busy_s", lambda: None)
    assert set_threads(None) == numba.config.NUMBA_NUM_THREADS
    threads.adapt_threads()
    assert numba.get_num_threads() == numba.config.NUMBA_NUM_THREADS


def test_the_first_automatic_choice_is_made_once_from_what_runs_now(monkeypatch):
    """A process's first automatic count is what the threads runnable now leave free, read once and without waiting
    (it was a 50 ms accounting window, a twentieth of a warm start), and later calls start from it: before, every
    ``set_threads(None)`` (four in a ``detinfer run``) chose again."""
    limit = numba.config.NUMBA_NUM_THREADS
    if limit < 2:
        pytest.skip("one core: there is no count to choose")
    reads, sleeps = [], []
    monkeypatch.setattr(threads, "_runnable_now", lambda: reads.append(1) or 1)  # one other thread runnable
    monkeypatch.setattr(threads, "time", SimpleNamespace(monotonic=time.monotonic, sleep=sleeps.append))
    monkeypatch.setattr(threads, "_last_choice", None)
    try:
        first = set_threads(None)
        assert first == limit - 1 == threads._last_choice == numba.get_num_threads() and reads == [1] and sleeps == []
        assert set_threads(None) == first and reads == [1]
    finally:
        monkeypatch.undo()
        set_threads(None)


@pytest.mark.parametrize("owner_alive", [True, False])
def test_a_second_thread_runs_its_default_at_one_thread_while_the_first_holds_the_pool(engine, monkeypatch, caplog, owner_alive):
    """numba's OpenMP layer gives each calling thread its own pool; two on 2 cores ran 2-thread passes 3.3x slower
    than 1 thread. While the thread that ran passes at more than 1 thread lives, another one's default count is 1,
    with one warning; the control: once that thread has ended, the other one takes over at every core."""
    limit = numba.config.NUMBA_NUM_THREADS
    if limit < 2:
        pytest.skip("one core: there is no count to choose")
    monkeypatch.setattr(threads, "adapt_threads", lambda: None)  # no load-dependent choice: only the pool rule
    monkeypatch.setattr(threads, "_last_choice", limit)
    monkeypatch.setattr(threads, "_pool_warned", False)
    ids = engine.tokenizer.encode("The capital of France is Paris.")
    with fixed_threads(limit):
        reference = engine.forward(ids, engine.new_cache())  # this thread may hold the pool
    if not owner_alive:
        ended = threading.Thread(target=lambda: None)
        ended.start()
        ended.join()
        monkeypatch.setattr(threads, "_pool_owner", ended)
    else:
        monkeypatch.setattr(threads, "_pool_owner", threading.current_thread())
    seen = {}

    def other():
        set_threads(None)
        seen["logits"] = engine.forward(ids, engine.new_cache())
        seen["count"] = numba.get_num_threads()

    with caplog.at_level("WARNING", logger="detinfer.threads"):
        t = threading.Thread(target=other, name="second")
        t.start()
        t.join()
    assert seen["logits"].tobytes() == reference.tobytes()
    if owner_alive:
        assert seen["count"] == 1
        assert "forward passes on thread 'second' while 'MainThread'" in caplog.text and "this thread uses 1" in caplog.text
    else:
        assert seen["count"] == limit and threads._pool_owner is not threading.current_thread() and not caplog.text

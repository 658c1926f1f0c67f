"""Lockstep: many generations on one engine, their forwards run together, one ``Engine.forward_batch`` per step.

Each task is a function of an engine (re-executing one record, running one batch line) that runs in its own
greenlet on a *view* of the engine: the same loaded model, whose ``forward`` does not compute but hands its call to
the scheduler and waits. Once every running task waits on a forward, the scheduler runs them all as one
``forward_batch`` step (each sequence gets the bytes it gets alone, whatever runs beside it) and resumes each task
with its logits; a finished task's place goes to the next one (continuous batching, as in the server's worker).

Greenlets, not threads: the tasks run one at a time on the calling thread, in a fixed order, so numba's thread
count (a per-thread setting), the engine's scratch buffers and what tasks share (a prefix cache) need no lock.
Decode is memory-bound (every step streams all weights), so B sequences per step cost far less than B steps.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Sequence, TypeVar

import numpy as np
from greenlet import GreenletExit, getcurrent, greenlet

from ..errors import InputError
from .engine import DEFAULT_CHUNK, Engine, check_chunk_size
from .kvcache import KVCache

DEFAULT_BATCH = 8  # sequences per step (verify, replay, batch and the server's worker): docs/benchmarks.md
R = TypeVar("R")


def check_batch(batch: int) -> int:
    """``batch`` (sequences per step) if it is at least 1; InputError otherwise."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise InputError(f"--batch must be at least 1 (1: one sequence at a time), got {batch!r}")
    return batch


@dataclass
class _Done:
    value: Any


@dataclass
class _Failed:
    error: BaseException


@dataclass
class _Task:
    index: int
    green: greenlet
    request: tuple[list[int], KVCache, bool]  # the forward it waits on: (tokens, cache, all_logits)


def lockstep(engine: Engine, tasks: Sequence[Callable[[Engine], R]], *, batch: int = DEFAULT_BATCH,
             on_result: Callable[[int, R], None] | None = None) -> list[R]:  # fmt: skip
    """Run every ``task(view)`` (``view``: ``engine`` whose forwards are batched), up to ``batch`` at once in the
    order given, and return their results in that order; ``on_result(index, result)`` as each finishes. A task's
    result is the one it returns when run alone: only which forwards share a step differs. A prefill is split into
    forwards of ``chunk_size`` tokens as ``Engine.forward`` splits it. A forward ``Engine.forward`` would refuse
    raises its InputError in that task only; any exception a task lets through stops the run and is raised here.
    Raises InputError for a ``batch`` below 1."""
    check_batch(batch)
    main = getcurrent()

    def forward(tokens, cache: KVCache, *, all_logits: bool = False, chunk_size: int = DEFAULT_CHUNK) -> np.ndarray:
        check_chunk_size(chunk_size)
        ids = [int(t) for t in tokens]
        outs = [main.switch((ids[at : at + chunk_size], cache, all_logits)) for at in range(0, max(len(ids), 1), chunk_size)]
        return np.concatenate(outs) if all_logits else outs[-1]

    view = copy.copy(engine)
    view.forward = forward
    results: list[Any] = [None] * len(tasks)
    running: list[_Task] = []
    waiting = list(enumerate(tasks))[::-1]

    def body(task: Callable[[Engine], R]) -> Callable[[], _Done | _Failed]:
        def run() -> _Done | _Failed:
            try:
                return _Done(task(view))
            except GreenletExit:  # a run stopped by another task's failure: this one is dropped
                raise
            except BaseException as e:  # raised on the scheduler's side, where the caller can see it
                return _Failed(e)

        return run

    def settle(index: int, green: greenlet, got: Any) -> None:
        """A task switched back: with a forward to run, or finished."""
        if isinstance(got, _Failed):
            raise got.error
        if isinstance(got, _Done):
            results[index] = got.value
            if on_result is not None:
                on_result(index, got.value)
        else:
            running.append(_Task(index, green, got))

    while waiting or running:
        while waiting and len(running) < batch:
            index, task = waiting.pop()
            green = greenlet(body(task))
            settle(index, green, green.switch())
        step, running[:] = list(running), []
        try:
            outs: list[Any] = engine.forward_batch([t.request for t in step])
        except InputError:  # an entry forward alone refuses: run each alone, so only its task sees the error
            outs = []
            for tokens, cache, all_logits in (t.request for t in step):
                try:
                    outs.append(engine.forward(tokens, cache, all_logits=all_logits, chunk_size=max(len(tokens), 1)))
                except InputError as e:
                    outs.append(e)
        for t, out in zip(step, outs):
            settle(t.index, t.green, t.green.throw(out) if isinstance(out, InputError) else t.green.switch(out))
    return results

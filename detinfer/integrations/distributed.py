"""Ray: run batch.py's tasks on a cluster of actors, each holding its engines, with retries when a worker dies.

An actor reserves ``threads`` CPUs (``num_cpus``) and runs numba with exactly that many threads, so no two thread
pools share a core (numba's pool spins: two on one core run many times slower). It keeps its engines between
items (loaded once per model), pulls a registry model itself (hash-verified) when its node lacks it, and reads
a model given as a path from that path, which every node must be able to read: weights never travel through the
object store. Items go one at a time to idle actors; a result comes back as a small object (a manifest's JSON at
most) and the driver hands it to ``on_result`` as it arrives. An actor whose process dies mid-item is replaced and
its item is run again elsewhere (at most ``MAX_ATTEMPTS`` times), so nothing is lost and nothing is counted twice.

Ray is an optional extra (``pip install 'detinfer[ray]'``); nothing here imports it before it is needed.
"""

from __future__ import annotations

import logging
import os
import re
from collections import deque
from contextlib import contextmanager
from functools import partial
from typing import Any, Callable, Iterator, Sequence, TypeVar

from ..errors import InputError
from .batch import WorkerState, run_local

LOCAL = "local"  # --ray without an address: start a cluster on this machine, sized to its cores
INSTALL = "pip install 'detinfer[ray]'"
LOCAL_OBJECT_STORE = 256 << 20  # bytes of shared memory for a LOCAL cluster's object store
MAX_ATTEMPTS = 3  # runs of one item whose worker died before it is reported as failed
_ADDRESS = re.compile(r"^(auto|local|ray://[^\s/]+:\d+|[A-Za-z0-9.\-]+:\d+)$")
R = TypeVar("R")


def import_ray():
    """The ``ray`` module; InputError naming the install command when the extra is not installed."""
    try:
        import ray
    except ImportError:
        raise InputError(f"--ray needs Ray, which is not installed; install it with: {INSTALL}") from None
    return ray


def check_address(address: str) -> str:
    """``address`` if it is one --ray takes (local, auto, ray://host:port, host:port), else InputError."""
    if not _ADDRESS.match(address):
        raise InputError(f"--ray {address!r} is not a Ray address; use auto, ray://HOST:PORT or HOST:PORT (or --ray alone for a "
                         "local cluster), and put files before --ray")
    return address


@contextmanager
def connect(address: str) -> Iterator[Any]:
    """Join the cluster at ``address`` or, for LOCAL, start one on this machine (one CPU per core this process may
    use, reachable on loopback only). A process already connected (ray.init was called) keeps its cluster. Shuts down only what it
    started. Raises InputError when Ray is missing or the cluster cannot be joined."""
    if address == LOCAL:  # a private cluster: node address 127.0.0.1 (read when ray is imported), nothing reported out
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray = import_ray()
    started = not ray.is_initialized()
    if started:
        options = dict(log_to_driver=False, logging_level=logging.ERROR, include_dashboard=False)
        try:
            if address == LOCAL:  # results are small (a manifest at most): a small object store is plenty
                ray.init(num_cpus=len(os.sched_getaffinity(0)), object_store_memory=LOCAL_OBJECT_STORE, **options)
            else:
                ray.init(address=address, **options)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise InputError(f"cannot join the Ray cluster at {address}: {str(e).splitlines()[0]}; start one with `ray start --head`") from None
    try:
        yield ray
    finally:
        if started:
            ray.shutdown()


class _Worker:
    """A Ray actor's body: numba set to ``threads`` threads, its WorkerState kept between items."""

    def __init__(self, threads: int, cwd: str):
        from ..compute.engine import set_threads

        if os.path.isdir(cwd):  # same relative paths as the driver where the node shares its filesystem
            os.chdir(cwd)
        set_threads(threads)
        self.state = WorkerState()

    def pid(self) -> int:
        return os.getpid()

    def run(self, task: Callable[[WorkerState, Any], R], payload: Any) -> R:
        return task(self.state, payload)


def run_on_ray(
    task: Callable[[WorkerState, Any], R],
    payloads: Sequence[Any],
    on_result: Callable[[int, R], None],
    failed: Callable[[Any, str], R],
    *,
    address: str = LOCAL,
    threads: int = 1,
    actors: int | None = None,
    on_dispatch: Callable[[int, int], None] | None = None,
) -> list[R]:
    """Run ``task(state, payload)`` for every payload on Ray actors; return the results in payload order.

    ``on_result(index, result)`` is called on the driver as each item finishes (finishing order);
    ``on_dispatch(index, worker pid)`` as each is sent. ``actors``: how many (default: as many as the cluster's
    CPUs hold at ``threads`` each, at most one per payload). An item whose actor dies is sent again to another
    actor; after MAX_ATTEMPTS deaths, or when the task raised (a bug, not bad input), its result is
    ``failed(payload, reason)``. Raises InputError for a cluster too small for ``actors`` × ``threads``.
    KeyboardInterrupt stops the actors and propagates; results already handed to ``on_result`` stay done.
    """
    if threads < 1:
        raise InputError(f"--threads must be at least 1, got {threads}")
    with connect(address) as ray:
        cpus = int(ray.cluster_resources().get("CPU", 0))
        if threads > cpus or (actors is not None and not 1 <= actors * threads <= cpus):
            want = f"{actors} actors × {threads} threads" if actors is not None else f"{threads} threads per actor"
            raise InputError(f"{want} need more CPUs than the Ray cluster has ({cpus}); lower --threads or --actors")
        n_actors = min(actors or cpus // threads, len(payloads))
        remote = ray.remote(num_cpus=threads, max_restarts=0, max_task_retries=0,
                            runtime_env={"env_vars": {"NUMBA_NUM_THREADS": str(threads)}})(_Worker)
        from ray.exceptions import RayActorError, RayTaskError, WorkerCrashedError

        def start() -> tuple[Any, int]:
            actor = remote.remote(threads, os.getcwd())
            try:
                return actor, ray.get(actor.pid.remote())
            except RayActorError as e:
                raise InputError(f"a Ray worker could not start: {str(e).splitlines()[0]}") from None

        pool: list[tuple[Any, int]] = []
        try:
            pool = [start() for _ in range(n_actors)]
            idle = list(pool)
            pending, attempts = deque(range(len(payloads))), [0] * len(payloads)
            results: list[Any] = [None] * len(payloads)
            inflight: dict[Any, tuple[tuple[Any, int], int]] = {}
            while pending or inflight:
                while pending and idle:
                    worker, i = idle.pop(), pending.popleft()
                    attempts[i] += 1
                    inflight[worker[0].run.remote(task, payloads[i])] = (worker, i)
                    if on_dispatch is not None:
                        on_dispatch(i, worker[1])
                [ref], _ = ray.wait(list(inflight), num_returns=1)
                worker, i = inflight.pop(ref)
                try:
                    results[i] = ray.get(ref)
                    idle.append(worker)
                except (RayActorError, WorkerCrashedError) as e:
                    ray.kill(worker[0])
                    pool.remove(worker)
                    replacement = start()
                    pool.append(replacement)
                    idle.append(replacement)
                    if attempts[i] < MAX_ATTEMPTS:
                        pending.appendleft(i)
                        continue
                    results[i] = failed(payloads[i], f"its worker died {attempts[i]} times running it ({type(e).__name__})")
                except RayTaskError as e:
                    idle.append(worker)
                    results[i] = failed(payloads[i], f"worker error: {type(e.cause).__name__}: {e.cause}")
                on_result(i, results[i])
            return results
        finally:
            for actor, _ in pool:
                ray.kill(actor)


def check_rederive(rederive: bool, ray: str | None) -> None:
    """``--rederive`` re-derives everything in the process that runs the work (numba's JIT cache too, which the CLI
    arranges for itself): a Ray worker would use its node's derived files. InputError for the two together."""
    if rederive and ray is not None:
        raise InputError("--rederive re-derives everything in this process (numba's JIT cache too); drop --ray")


def fan_out(task: Callable[..., R], payloads: Sequence[Any], on_result: Callable[[int, R], None], failed: Callable[[Any, str], R],
            *, ray: str | None = None, threads: int = 1, actors: int | None = None,
            local: Callable[[Sequence[Any], Callable[[int, R], None]], list[R]] | None = None) -> list[R]:  # fmt: skip
    """``task`` over ``payloads`` in this process (``ray`` None: ``local(payloads, on_result)`` if given, else one after
    another) or on the Ray cluster at ``ray``, where each worker may pull a missing registry model (``pull=True``).
    Results in payload order; see :func:`run_on_ray`."""
    if ray is None or not payloads:
        return (local or partial(run_local, task))(payloads, on_result)
    return run_on_ray(partial(task, pull=True), payloads, on_result, failed, address=ray, threads=threads, actors=actors)

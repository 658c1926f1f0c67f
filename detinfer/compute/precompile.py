"""A cold start's kernels compiled on two cores: this process and one helper process share the work.

numba compiles a kernel on its first call, one at a time, holding the interpreter: an empty JIT cache costs a first
run 15-30 s on one core while the machine's other cores idle. :func:`warm` runs a warm-up (Engine.warm_up's two
forwards, with the sampler's warm-up as a call) so that, when a kernel is missing from the cache, the work is shared instead:

1. A dry run of the same warm-up records every (kernel, argument types) it would compile, compiling nothing: each
   uncompiled kernel call returns at once (scalar-only calls run as plain Python, so values like a slice count
   stay right; every other kernel writes into arrays the dry run throws away).
2. This process and a helper (``python -m detinfer.compute.precompile``) take jobs in call order, each claiming
   one with an exclusive file: a kernel signature, or a call that compiles kernels a dry run cannot see (those
   whose results Python reads, such as the sampler's). The helper writes into a numba cache folder of
   its own, so no two processes ever write one index file (numba's index is read, changed and written whole).
3. The helper's cache entries of each kernel it compiled are added to this process's cache, through numba's own
   index code, where this cache lacks them. Then the warm-up runs for real and loads them.

Only signatures this cache lacks are shared. numba keys every cache entry on the signature, the compile target and
the kernel's bytecode; a helper with a different view of any of them writes entries this process never loads. So the worst a failed, slow or killed helper can do is leave its
kernels to this process, compiled as before: results never depend on who compiled what. ``DETINFER_COMPILE_HELPER=0``
turns the helper off.
"""

from __future__ import annotations

import importlib
import os
import pickle
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numba
import numpy as np
from numba.core import caching
from numba.core.dispatcher import Dispatcher

HELPER_ENV = "DETINFER_COMPILE_HELPER"
HELPER_TIMEOUT_S = 600.0


class _Miss(Exception):
    """A kernel the warm-up calls is not in numba's cache."""


@dataclass
class Shared:
    """What :func:`warm` did: ``here`` and ``helper``, the kernels (module.qualname) each compiled; ``merged``, the
    helper's kernels copied into this process's cache; ``problem``, why the helper did not run or finish (or "")."""

    here: list[str] = field(default_factory=list)
    helper: list[str] = field(default_factory=list)
    merged: list[str] = field(default_factory=list)
    problem: str = ""


Call = tuple[Callable[..., None], tuple]  # a module-level function and its (picklable) arguments


def warm(run: Callable[[], None], calls: Sequence[Call] = ()) -> Shared | None:
    """Run ``run`` (a warm-up: calls every kernel a model uses). When every kernel loads from numba's cache, that
    is all (None). At the first one that would compile, ``run`` is cut short and the missing kernels, and
    ``calls`` (run only then: warm-ups of kernels used later), are compiled here and in a helper process at once
    (see the module docstring), then ``run`` runs again, loading them."""
    if not _cut_at_first_miss(run):
        return None
    jobs = [(d, [sig]) for d, sigs in _dry_run(run) for sig in _uncached(d, sigs)]
    jobs.sort(key=_compile_cost, reverse=True)
    shared = Shared()
    if _helper_allowed() and len(jobs) + len(calls) >= 2:
        _share(jobs, list(calls), shared)
    run()
    return shared


def _helper_allowed() -> bool:
    """A helper only where the forward pass would run 2 threads or more (compute/threads.py: not beside a busy
    core, not with ``--threads 1``), and unless ``DETINFER_COMPILE_HELPER=0``."""
    return os.environ.get(HELPER_ENV, "1") != "0" and numba.get_num_threads() >= 2


def _cut_at_first_miss(run: Callable[[], None]) -> bool:
    """Run ``run`` until a kernel's cache lookup misses; True if one did (``run`` did not finish)."""
    load, me = caching.Cache.load_overload, threading.get_ident()

    def load_or_stop(self, sig, target_context):
        cres = load(self, sig, target_context)
        if cres is None and threading.get_ident() == me:  # another thread's kernels compile as ever
            raise _Miss
        return cres

    caching.Cache.load_overload = load_or_stop
    try:
        run()
    except _Miss:
        return True
    finally:
        caching.Cache.load_overload = load
    return False


def _dry_run(run: Callable[[], None]) -> list[tuple[Dispatcher, list[tuple]]]:
    """Every uncompiled kernel ``run`` calls directly, in first-call order, with the argument types of each call.
    numpy's floating-point warnings are off meanwhile (Gemma's embedding scale overflowed on the garbage of an
    unwritten scratch buffer and warned on every cold start)."""
    seen: dict[Dispatcher, list[tuple]] = {}
    compile_for_args, me = Dispatcher._compile_for_args, threading.get_ident()

    def record(self, *args, **kws):
        if threading.get_ident() != me:  # another thread's calls compile and run as ever
            return compile_for_args(self, *args, **kws)
        types = tuple(self.typeof_pyval(a) for a in args)
        if types not in seen.setdefault(self, []):
            seen[self].append(types)
        # numba calls what this returns with the arguments
        return self.py_func if all(isinstance(a, (int, float)) for a in args) else _nothing

    Dispatcher._compile_for_args = record
    try:
        with np.errstate(all="ignore"):  # numpy steps between kernels read arrays no kernel wrote: their values are noise
            run()
    except Exception:  # noqa: BLE001 - a warm-up the dry run cannot finish: share what was recorded so far
        pass
    finally:
        Dispatcher._compile_for_args = compile_for_args
    return [(d, sigs) for d, sigs in seen.items() if _cacheable(d)]


def _compile_cost(job: tuple[Dispatcher, list[tuple]]) -> tuple[bool, int]:
    """A kernel job's rank by how long it compiles, for :func:`_compile_claimed`: parallel kernels first (numba
    compiles a parallel loop's body twice), then by the bytecode length of the kernel and of the kernels it calls,
    which compile with it (attention's and matmul_q's are the longest; rope_fill's own is short, but its five
    float64 functions made it the last job, 0.36 s, while the other process idled)."""
    d = job[0]
    return bool(d.targetoptions.get("parallel")), _bytecode(d.py_func, set())


def _bytecode(f: Callable, seen: set[Dispatcher]) -> int:
    """Bytecode length of ``f`` and of each numba kernel it calls (a global of its module), each counted once."""
    n = len(f.__code__.co_code)
    for name in f.__code__.co_names:
        g = f.__globals__.get(name)
        if isinstance(g, Dispatcher) and g not in seen:
            seen.add(g)
            n += _bytecode(g.py_func, seen)
    return n


def _nothing(*args, **kws) -> None:
    return None


def _cacheable(d: Dispatcher) -> bool:
    return isinstance(getattr(d, "_cache", None), caching.Cache) and hasattr(d._cache, "_cache_file")


def _name(d: Dispatcher) -> str:
    return f"{d.py_func.__module__}.{d.py_func.__qualname__}"


def _uncached(d: Dispatcher, sigs: list[tuple]) -> list[tuple]:
    """The signatures of ``sigs`` this process's cache has no entry for (by numba's own index key)."""
    try:
        have, codegen = d._cache._cache_file._load_index(), d.targetctx.codegen()
        return [sig for sig in sigs if d._cache._index_key(sig, codegen) not in have]
    except Exception:  # noqa: BLE001 - numba's private cache API changed: leave the kernel to this process
        return []


def _claim(claims: Path, i: int) -> bool:
    try:
        os.close(os.open(claims / str(i), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def _compile_claimed(jobs: list[tuple[Dispatcher | None, list[tuple]]], calls: list[Call], claims: Path) -> list[int]:
    """Run each call this process claims, then compile every signature of each kernel job it claims (claims are
    numbered kernels first, calls after); the indices of the kernel jobs it compiled. The longest jobs go first, so
    the last one taken, which decides when both processes are done, is short: the calls (each compiles several
    kernels: Gemma 3's sampler warm-up took 2.3 s), then the kernel jobs as :func:`warm` ranked them
    (:func:`_compile_cost`: attention and matmul_q took 3-4 s each, most others 0.1-1 s)."""
    for i, (f, args) in enumerate(calls, len(jobs)):
        if f is not None and _claim(claims, i):
            f(*args)
    done = []
    for i, (d, sigs) in enumerate(jobs):
        if d is not None and _claim(claims, i):
            for sig in sigs:
                d.compile(sig)
            done.append(i)
    return done


def _share(jobs: list[tuple[Dispatcher, list[tuple]]], calls: list[Call], shared: Shared) -> None:
    with tempfile.TemporaryDirectory(prefix="detinfer-compile-") as tmp:
        work = Path(tmp)
        (work / "claims").mkdir()
        job_file = work / "jobs.pickle"
        job_file.write_bytes(pickle.dumps(([(d.py_func.__module__, d.py_func.__qualname__, s) for d, s in jobs],
                                           [(f.__module__, f.__qualname__, args) for f, args in calls])))  # fmt: skip
        env = dict(os.environ, NUMBA_CACHE_DIR=str(work / "cache"), **{HELPER_ENV: "0"})
        with open(work / "stderr", "wb") as stderr:  # a file: a pipe nobody reads until the end could fill
            helper = subprocess.Popen([sys.executable, "-m", __name__, str(work)], env=env, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, stderr=stderr)  # fmt: skip
        try:
            mine = _compile_claimed(jobs, calls, work / "claims")
            helper.wait(timeout=HELPER_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            helper.kill()
            helper.wait()
        except BaseException:
            helper.kill()
            helper.wait()
            raise
        shared.here = [_name(jobs[i][0]) for i in mine]
        done_file = work / "done.pickle"
        if helper.returncode != 0 or not done_file.exists():
            last = (work / "stderr").read_text(errors="replace").strip().splitlines()[-1:] or [f"exit code {helper.returncode}"]
            shared.problem = f"the compile helper stopped: {last[0][:200]}"
            return
        for module, qualname, cache_path in pickle.loads(done_file.read_bytes()):
            d = _resolve(module, qualname)
            if d is not None:
                shared.helper.append(_name(d))
                if _merge(d, Path(cache_path)):
                    shared.merged.append(_name(d))


def _merge(d: Dispatcher, source: Path) -> bool:
    """Add the helper's cache entries of ``d`` (from its cache folder ``source``) to this process's cache through
    numba's own index file code (which reads the index, adds the entry, names a free data file, writes both), for
    every entry this cache lacks; an index of another numba version or source reads as empty there. True if it
    added any. Any failure (a folder this process cannot write) adds nothing: the kernel compiles here."""
    mine = d._cache._cache_file
    try:
        base = mine._index_name[: -len(".nbi")]
        theirs = caching.IndexDataCacheFile(str(source), base, mine._source_stamp)
        have, added = mine._load_index(), False
        for key in theirs._load_index():
            if key not in have and (data := theirs.load(key)) is not None:  # checked (compute/jit_cache.py), then sealed anew
                mine.save(key, data)
                added = True
        return added
    except Exception:  # noqa: BLE001 - numba's private cache API changed, or the folder is not writable
        return False


def _resolve(module: str, qualname: str) -> Any:
    """A module-level object by name (None if there is none)."""
    try:
        return getattr(importlib.import_module(module), qualname, None)
    except ImportError:
        return None


def _helper(work: Path) -> None:
    """The helper process: compile the claimed jobs of ``work/jobs.pickle`` into its own cache, then list every
    kernel of detinfer it compiled (the calls' ones too), with its cache folder, in ``work/done.pickle``. Run as
    ``-m``, it has imported the detinfer package first, whose jit.configure() set the parent's compile target."""
    kernel_jobs, call_jobs = pickle.loads((work / "jobs.pickle").read_bytes())
    jobs = []
    for module, qualname, sigs in kernel_jobs:
        d = _resolve(module, qualname)
        jobs.append((d, sigs) if isinstance(d, Dispatcher) and _cacheable(d) else (None, []))  # None: left to the parent
    calls = [(_resolve(module, qualname), args) for module, qualname, args in call_jobs]
    _compile_claimed(jobs, [(f if callable(f) else None, args) for f, args in calls], work / "claims")
    compiled = {(d.py_func.__module__, d.py_func.__qualname__, d._cache._cache_path)
                for name, module in list(sys.modules.items()) if name.startswith("detinfer.")
                for d in vars(module).values()
                if isinstance(d, Dispatcher) and _cacheable(d) and d._cache_misses and d.py_func.__module__ == name}
    tmp = work / "done.pickle.tmp"
    tmp.write_bytes(pickle.dumps(sorted(compiled)))
    os.replace(tmp, work / "done.pickle")


if __name__ == "__main__":
    _helper(Path(sys.argv[1]))
    sys.stderr.flush()
    os._exit(0)  # not the interpreter's teardown of numba and LLVM: 0.3-0.5 s the parent waited for at every cold start

"""The ``detinfer`` command: a thin typer shell over the library (detinfer.api, .serve, .integrations, .bench).
Each command module registers itself on the one app (common.py); errors become one line and an exit code there.

Exit codes: 0 success, 1 a re-executed record does not match, 2 bad input, 130 interrupted.
"""

from __future__ import annotations

import sys
from typing import NoReturn

from . import bench, models, records, run, serve  # noqa: F401 (each registers its commands)
from .common import REDERIVE, app

__all__ = ["app", "main"]


def _bare_ray(args: list[str]) -> list[str]:
    """``--ray`` last or before another option means ``--ray local``: a click option cannot have an optional value."""
    return [x for i, a in enumerate(args)
            for x in ([a, "local"] if a == "--ray" and (i + 1 == len(args) or args[i + 1].startswith("-")) else [a])]


_FRESH_JIT = "DETINFER_FRESH_JIT_CACHE"  # set by _fresh_jit_cache in the process it re-executes


def _fresh_jit_cache() -> None:
    """``--rederive`` compiles every kernel anew. numba picks its cache folder (NUMBA_CACHE_DIR) when a kernel is
    decorated, which importing this package has already done, so the command runs again in place (exec: the same
    process id, stdin and stdout) with NUMBA_CACHE_DIR a new temporary folder, removed when that run ends."""
    import os

    fresh = os.environ.get(_FRESH_JIT)
    if fresh is not None and fresh == os.environ.get("NUMBA_CACHE_DIR"):
        import atexit
        import shutil

        atexit.register(shutil.rmtree, fresh, ignore_errors=True)
        return
    import tempfile

    folder = tempfile.mkdtemp(prefix="detinfer-jit-")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], dict(os.environ, NUMBA_CACHE_DIR=folder, **{_FRESH_JIT: folder}))


def main() -> None:
    """The ``detinfer`` command; it ends with :func:`_quick_exit`."""
    if REDERIVE in sys.argv[1:]:
        _fresh_jit_cache()
    try:
        app(args=_bare_ray(sys.argv[1:]), prog_name="detinfer")
    except SystemExit as e:
        _quick_exit(e.code)
    _quick_exit(0)


def _quick_exit(code: int | str | None) -> NoReturn:
    """End the process without tearing the interpreter down: freeing every object of numba, LLVM and a loaded model
    takes ~0.2 s after the command is done (a fifth of a warm start), and nothing needs it. What a normal exit
    must do still happens first: non-daemon threads (a repacked-weights save) are joined, atexit handlers run (Ray
    shutdown, temporary folders), stdout and stderr are flushed; every file detinfer writes is closed and fsynced
    by then. mypy ends the same way (``mypy.util.hard_exit``). A ``code`` that is a message is printed, exit 1;
    an unwritable stdout (a closed pipe) exits 120, as Python's own exit does."""
    import atexit
    import os
    import threading

    if isinstance(code, str):
        sys.stderr.write(code + "\n")
        code = 1
    for t in threading.enumerate():
        if t is not threading.main_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        code = code or 120
    try:
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    os._exit(code or 0)

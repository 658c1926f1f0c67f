"""detinfer: determinism-first LLM inference on the CPU.

``detinfer.load()`` loads a model (:class:`detinfer.LLM`); ``llm.complete`` / ``llm.chat`` / ``llm.stream`` /
``llm.session`` run it; ``detinfer.verify(paths)`` re-executes recorded runs. See detinfer/api.py; the README's "Where things are" maps the subpackages.
"""

from .compute.cores import cap_numba_threads as _cap_numba_threads
from .compute.jit import configure as _configure_jit
from .compute.jit_cache import seal_jit_cache as _seal_jit_cache
from .version import __version__

_cap_numba_threads()  # before numba is imported, so its pool fits a container's CPU quota
_configure_jit()  # before any kernel compiles
_seal_jit_cache()  # before any kernel loads from numba's cache

__all__ = ["Constraint", "DetinferError", "LLM", "Outcome", "Result", "Sampling", "SessionResult", "Step", "Stream", "VerifyResult", "load",
           "replay", "verify", "__version__"]


def __getattr__(name: str):
    """The public names come from detinfer.api, imported on first use: a process that imports one subpackage (the
    compile helper, a kernel test) does not pay for the whole library's import."""
    if name == "DetinferError":
        from .errors import DetinferError

        return DetinferError
    if name in __all__:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'detinfer' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})

"""detinfer: determinism-first LLM inference on the CPU.

``detinfer.load()`` loads a model (:class:`detinfer.LLM`); ``llm.complete`` / ``llm.chat`` / ``llm.stream`` /
``llm.session`` run it; ``detinfer.verify(paths)`` re-executes recorded runs. See detinfer/api.py.
"""

__version__ = "0.1.0"

from .jit import configure as _configure_jit  # noqa: E402

_configure_jit()  # before any kernel compiles

# After __version__ (run.py reads it). The function ``verify`` replaces the submodule of that name as the package's
# attribute: ``detinfer.verify(paths)``; the module stays importable as ``from detinfer.verify import ...``.
from .api import Constraint, LLM, Result, Sampling, SessionResult, Step, Stream, VerifyResult, load, verify  # noqa: E402
from .errors import DetinferError  # noqa: E402

__all__ = ["Constraint", "DetinferError", "LLM", "Result", "Sampling", "SessionResult", "Step", "Stream", "VerifyResult", "load", "verify", "__version__"]

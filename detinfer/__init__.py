"""detinfer: determinism-first LLM inference on the CPU.

``detinfer.load()`` loads a model (:class:`detinfer.LLM`); ``llm.complete`` / ``llm.chat`` / ``llm.stream`` /
``llm.session`` run it; ``detinfer.verify(paths)`` re-executes recorded runs. See detinfer/api.py; the README's "Where things are" maps the subpackages.
"""

from .version import __version__
from .compute.jit import configure as _configure_jit

_configure_jit()  # before any kernel compiles

from .api import Constraint, LLM, Result, Sampling, SessionResult, Step, Stream, VerifyResult, load, verify  # noqa: E402
from .errors import DetinferError  # noqa: E402

__all__ = ["Constraint", "DetinferError", "LLM", "Result", "Sampling", "SessionResult", "Step", "Stream", "VerifyResult", "load", "verify", "__version__"]

"""detinfer: determinism-first LLM inference on the CPU.

``detinfer.load()`` loads a model (:class:`detinfer.LLM`); ``llm.complete`` / ``llm.chat`` / ``llm.stream`` /
``llm.session`` run it; ``detinfer.verify(paths)`` re-executes recorded runs. See detinfer/api.py; the README's "Where things are" maps the subpackages.
"""

from .compute.jit import configure as _configure_jit
from .version import __version__

_configure_jit()  # before any kernel compiles

from .api import (  # noqa: E402
    LLM,
    Constraint,
    Outcome,
    Result,
    Sampling,
    SessionResult,
    Step,
    Stream,
    VerifyResult,
    load,
    replay,
    verify,
)
from .errors import DetinferError  # noqa: E402

__all__ = ["Constraint", "DetinferError", "LLM", "Outcome", "Result", "Sampling", "SessionResult", "Step", "Stream", "VerifyResult", "load",
           "replay", "verify", "__version__"]

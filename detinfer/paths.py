"""Where detinfer keeps its files: ``$DETINFER_HOME`` (default ``~/.cache/detinfer``)."""

from __future__ import annotations

import os
from pathlib import Path


def detinfer_home() -> Path:
    """The cache root: models under ``models/``, parsed GGUF indexes under ``index/``, repacked weights under
    ``weights/`` (unless ``$DETINFER_WEIGHTS_CACHE`` says elsewhere, :mod:`detinfer.weights_cache`)."""
    return Path(os.environ.get("DETINFER_HOME") or Path.home() / ".cache" / "detinfer")


def models_dir() -> Path:
    return detinfer_home() / "models"

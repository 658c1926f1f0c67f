"""detinfer's version (pyproject.toml reads it)."""

__version__ = "0.1.0"

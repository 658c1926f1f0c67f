"""The one engine cache: engines by (model sha256, n_ctx, kv_type), each loaded once, and where a record's model
is found, decided in one place for verify, replay, batch runs and the golden cases."""

from __future__ import annotations

import os
from collections import OrderedDict

from ..compute.engine import Engine
from ..compute.prefix_cache import PrefixCache
from ..errors import ManifestError
from ..model.registry import name_for_sha256
from .reader import Record


class EngineCache:
    """Engines loaded for records. ``model``: a registry name or .gguf path that overrides every record's own
    (``--model``; its sha256 must still match). At most ``keep`` engines stay loaded (least recently used go first):
    a model in memory costs its weights. ``cache_bytes``: the budget of each engine's prefix cache (replay).
    ``rederive``: every engine is loaded from its GGUF alone, using no derived file (:meth:`Engine.load`)."""

    def __init__(self, model: str | os.PathLike | None = None, *, keep: int = 4, cache_bytes: int = 1 << 30,
                 rederive: bool = False):  # fmt: skip
        self.model, self.keep, self.cache_bytes, self.rederive = model, keep, cache_bytes, rederive
        self._engines: OrderedDict[tuple, tuple[Engine, PrefixCache]] = OrderedDict()

    def load(self, source: str | os.PathLike | None, n_ctx: int, kv_type: str) -> Engine:
        """The engine of a registry name or path (None: the default model), loaded once per (file, n_ctx, kv_type)."""
        return self._get(("source", str(source), n_ctx, kv_type), lambda: self._load(source, n_ctx, kv_type))[0]

    def for_record(self, record: Record) -> Engine:
        """The engine of the model ``record`` was computed with: the override, else the registry name or path the
        record names, else the registry entry of its sha256. ManifestError if none is found or the file found has
        another sha256 (the fix: --model)."""
        sha256 = record.model_sha256

        def load() -> Engine:
            names = [self.model] if self.model is not None else record.model_names or [name_for_sha256(sha256)]
            source = next((n for n in names if n is not None), None)
            if source is None:
                raise ManifestError(f"{record.path} was recorded with model sha256 {sha256[:16]}..., which is no registry "
                                    "model; pass that model's file with --model")  # fmt: skip
            engine = self._load(source, record.n_ctx, record.kv_type)
            if engine.model_file.sha256 != sha256:
                raise ManifestError(f"{record.path} was recorded with model sha256 {sha256[:16]}..., not "
                                    f"{engine.model_file.path.name} ({engine.model_file.sha256[:16]}...); pass that model with --model")  # fmt: skip
            return engine

        return self._get((sha256, record.n_ctx, record.kv_type), load)[0]

    def _load(self, source: str | os.PathLike | None, n_ctx: int, kv_type: str) -> Engine:
        return Engine.load(source, n_ctx=n_ctx, kv_type=kv_type, rederive=self.rederive)

    def __len__(self) -> int:
        """How many engines are loaded now."""
        return len(self._engines)

    def prefix_cache(self, engine: Engine) -> PrefixCache:
        """The prefix cache kept with ``engine`` (sessions replayed one after another reuse each other's prefixes)."""
        return next(pc for e, pc in self._engines.values() if e is engine)

    def _get(self, key: tuple, load) -> tuple[Engine, PrefixCache]:
        if key not in self._engines:
            while len(self._engines) >= self.keep:
                self._engines.popitem(last=False)
            self._engines[key] = (load(), PrefixCache(self.cache_bytes))
        self._engines.move_to_end(key)
        return self._engines[key]

"""Models from Python: download registry models, list them, describe a model file (config, tensor types,
parameters, KV cache arithmetic) without loading its weights, and compile a model's kernels ahead of use."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..compute.kvcache import CHECKPOINT_EVERY, CHECKPOINTS, KV_TYPES, kv_bytes_per_number
from ..errors import InputError
from ..model.config import ModelConfig
from ..model.gguf_file import ModelFile
from ..model.registry import DEFAULT_MODEL, list_models, pull, resolve_model

__all__ = ["DEFAULT_MODEL", "ModelInfo", "WarmUp", "jit_cache_files", "list_models", "model_info", "pull", "warm_up"]

CONFIG_FIELDS = ("arch", "n_vocab", "n_ctx_train", "n_embd", "n_layer", "n_head", "n_head_kv", "head_dim", "n_ff",
                 "rope_freq_base", "rms_norm_eps", "tied_embeddings")  # fmt: skip


@dataclass(frozen=True)
class ModelInfo:
    """What ``detinfer info`` shows: the file (name, sha256, bytes), parameters, tensor-type counts, the config, and
    the KV cache's bytes per position and at ``n_ctx`` for each KV type (``kv``: type -> (per position, at n_ctx))."""

    file_name: str
    sha256: str
    size: int
    n_params: int
    tensor_types: dict[str, int]
    config: ModelConfig
    n_ctx: int
    kv: dict[str, tuple[int, int]]

    @property
    def checkpoints(self) -> tuple[int, int, int]:
        """A hybrid model's state checkpoints: (kept per cache, positions between two, their bytes at most)."""
        return CHECKPOINTS, CHECKPOINT_EVERY, CHECKPOINTS * self.config.state_bytes

    @property
    def config_rows(self) -> list[tuple[str, str]]:
        cfg = self.config
        rows = [(f, str(getattr(cfg, f))) for f in CONFIG_FIELDS]
        if cfg.state_bytes:
            rec = [str(i) for i, r in enumerate(cfg.recurrent_layers) if r]
            rows += [("recurrent layers", f"{', '.join(rec)} (Gated DeltaNet); n_rot {cfg.n_rot}"),
                     ("ssm", f"conv_kernel {cfg.ssm_conv_kernel}, n_k_head {cfg.ssm_n_k_head}, n_v_head {cfg.ssm_n_v_head}, "
                             f"head_k {cfg.ssm_head_k}, head_v {cfg.ssm_head_v}")]  # fmt: skip
        if cfg.sliding_window:
            local = [str(i) for i, swa in enumerate(cfg.swa_layers) if not swa]
            rows.append(("sliding_window", f"{cfg.sliding_window} (local layers: rope_freq_base {cfg.rope_freq_base_swa}; "
                                           f"global: {', '.join(local)})"))  # fmt: skip
        return rows


def model_info(model: str | os.PathLike | None = None, *, n_ctx: int = 4096) -> ModelInfo:
    """Describe a registry model or .gguf file (its metadata only: the weights are not read). Raises GGUFError,
    ConfigError, PullError, or InputError for an ``n_ctx`` the model does not support."""
    mf = ModelFile(resolve_model(model))
    cfg = ModelConfig.from_model(mf)
    if not 1 <= n_ctx <= cfg.n_ctx_train:
        raise InputError(f"--ctx {n_ctx} is out of range; this model supports 1..{cfg.n_ctx_train} positions")
    kv = {t: (cfg.kv_bytes(1, kv_bytes_per_number(t)), cfg.kv_bytes(n_ctx, kv_bytes_per_number(t))) for t in KV_TYPES}
    return ModelInfo(mf.path.name, mf.sha256, mf.size, mf.n_params(), mf.type_counts(), cfg, n_ctx, kv)


@dataclass(frozen=True)
class WarmUp:
    """One model's :func:`warm_up`: its file name, wall seconds, and the JIT cache files it added (0: every kernel
    was already there, loaded rather than compiled)."""

    file_name: str
    seconds: float
    new_cache_files: int


def jit_cache_files() -> set[Path]:
    """numba's cache files of detinfer's kernels (index .nbi and code .nbc): under ``NUMBA_CACHE_DIR`` if set, else
    in the ``__pycache__`` folders beside detinfer's sources (numba's default)."""
    import numba

    root = Path(numba.config.CACHE_DIR) if numba.config.CACHE_DIR else Path(__file__).parents[1]
    return {p for p in root.rglob("*.nb[ic]") if p.is_file()}


def warm_up(models: Sequence[str | os.PathLike | None] = (None,), *, kv_type: str = "f32",
            on_model: Callable[[str], None] | None = None) -> list[WarmUp]:  # fmt: skip
    """Compile (or load from numba's cache) every kernel ``run``, ``verify`` and ``serve`` use on each model, for
    the compile target in effect (``DETINFER_CPU_LEVEL``, else this CPU): a prefill chunk, a decode step and a
    sampled token, with ``kv_type``'s KV cache. Made for CI runners: warm-up once, keep ``NUMBA_CACHE_DIR``.
    ``on_model(name)`` is called before each model loads. Raises what :func:`detinfer.load` raises."""
    from .llm import load

    done = []
    for model in models:
        if on_model is not None:
            on_model(str(model or DEFAULT_MODEL))
        before, t0 = jit_cache_files(), time.perf_counter()
        llm = load(model, n_ctx=64, kv_type=kv_type)
        llm.warm_up()
        llm.complete("Hello", max_tokens=2, temperature=0.8, top_p=0.9, seed=0)
        done.append(WarmUp(llm.engine.model_file.path.name, time.perf_counter() - t0, len(jit_cache_files() - before)))
    return done

"""``detinfer pull``, ``models`` and ``info``: the registry and what a model file holds."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.markup import escape
from rich.table import Table

from .. import api
from ..errors import DetinferError
from .common import CtxOpt, KvOpt, app, err, fail, flag, out


@app.command()
def pull(
    name: Annotated[Optional[str], typer.Argument(help="Registry name (default: the default model).")] = None,
    force: Annotated[bool, flag("--force", help="Download again even if present.")] = False,
) -> None:
    """Download a registry model into $DETINFER_HOME/models and verify its sha256."""
    try:
        path = api.pull(name or api.DEFAULT_MODEL, force=force)
    except DetinferError as e:
        fail(e)
    err.print(f"{escape(path.name)}: size and sha256 verified")  # stdout stays the path alone, for scripts
    out.print(str(path))


@app.command()
def models() -> None:
    """List the registry and what is downloaded."""
    table = Table("name", "size", "present", "sha256", "description")
    for row in api.list_models():
        table.add_row(row["name"], f"{row['size'] / 1e6:.1f} MB", "yes" if row["present"] else "no", row["sha256"][:16] + "…", row["description"])
    out.print(table)


def _binary(n: int) -> str:
    """A byte count in MiB, or KiB below one (a tiny model's KV cache printed "0.0 MiB")."""
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


@app.command()
def info(
    model: Annotated[Optional[str], typer.Argument(help="Registry name or .gguf path.")] = None,
    ctx: CtxOpt = 4096,
) -> None:
    """Show a model's config, tensor types, parameter count and KV cache size."""
    try:
        mi = api.model_info(model, n_ctx=ctx)
    except DetinferError as e:
        fail(e)
    table = Table("key", "value", title=escape(mi.file_name))
    table.add_row("sha256", mi.sha256)
    table.add_row("file size", f"{mi.size:,} bytes")
    table.add_row("parameters", f"{mi.n_params:,}")
    table.add_row("tensor types", ", ".join(f"{k}: {v}" for k, v in mi.tensor_types.items()))
    for key, value in mi.config_rows:
        table.add_row(key, value)
    out.print(table)
    cfg = mi.config
    n_rec = sum(cfg.recurrent_layers)
    layers = "attention layers" if n_rec else "n_layer"
    kv = Table("kv type", "bytes / position", f"bytes at n_ctx={ctx}", title=f"KV cache = {layers} × positions × 2 × kv_width × bytes_per_number")
    for kv_type, (per_position, total) in mi.kv.items():
        kv.add_row(kv_type, f"{per_position:,}", f"{total:,} ({_binary(total)})")
    out.print(kv)
    split = f" ({cfg.n_attn_layer} attention, {n_rec} Gated DeltaNet)" if n_rec else ""
    out.print(f"kv_width = n_head_kv × head_dim = {cfg.n_head_kv} × {cfg.head_dim} = {cfg.kv_width}; n_layer = {cfg.n_layer}{split}")
    if n_rec:
        K, conv, (h, dv, dk) = cfg.ssm_conv_kernel, cfg.ssm_conv_width, (cfg.ssm_n_v_head, cfg.ssm_head_v, cfg.ssm_head_k)
        out.print(f"recurrent state = Gated DeltaNet layers × ((K − 1) × conv_width + n_v_head × head_v × head_k) × 4 bytes = "
                  f"{n_rec} × ({K - 1} × {conv} + {h} × {dv} × {dk}) × 4 = {cfg.state_bytes:,} bytes "
                  f"({_binary(cfg.state_bytes)}) per sequence, whatever its length", soft_wrap=True)  # fmt: skip
        kept, every, budget = mi.checkpoints
        out.print(f"state checkpoints: the {kept} latest per cache (after each prompt, at each turn's end, every {every} "
                  f"positions), at most {kept} × {cfg.state_bytes:,} = {budget:,} bytes", soft_wrap=True)


@app.command("warm-up")
def warm_up(
    models: Annotated[Optional[list[str]], typer.Argument(help="Registry names or .gguf paths (default: the default model).")] = None,
    kv_type: KvOpt = "f32",
) -> None:
    """Compile the kernels of run, verify and serve for these models into numba's JIT cache (for CI runners).

    The cache is NUMBA_CACHE_DIR's; the target DETINFER_CPU_LEVEL if set (e.g. x86-64-v3: loads on any CPU of that
    level), else this CPU. For CI runners: warm up once, keep the cache (its key: detinfer cache-key)."""
    try:
        from ..integrations.ci_report import cache_target

        target = cache_target()
        done = api.warm_up(models or [None], kv_type=kv_type, on_model=lambda name: err.print(f"{api.PROGRESS_MARK} for {escape(name)} ({target})…"))
    except DetinferError as e:
        fail(e)
    for w in done:
        what = f"{w.new_cache_files} new JIT cache files" if w.new_cache_files else "every kernel loaded from the JIT cache"
        out.print(f"{escape(w.file_name)}: {w.seconds:.1f} s, {what} (target {target})", soft_wrap=True)


@app.command("cache-key")
def cache_key(
    model: Annotated[Optional[str], typer.Argument(help="Registry name or .gguf path (default: the default model).")] = None,
) -> None:
    """Print the CI cache key of a model and its compiled kernels.

    The key holds detinfer's, numba's and Python's versions, the model's sha256 and this CPU's instruction-set level
    and name: a runner of another CPU or version never restores it."""
    from ..integrations.ci_report import cache_key as key

    try:
        out.print(key(model), soft_wrap=True)
    except DetinferError as e:
        fail(e)

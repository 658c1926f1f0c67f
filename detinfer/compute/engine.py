"""The engine: a loaded model and its forward pass (one entry point for prefill and decode).

``forward`` takes a chunk of n >= 1 tokens at the positions after those already in the KV cache. Decode is the
n = 1 case of the same kernels in the same order, so chunked prefill, whole-prompt prefill, prefix reuse and
one-token decode all produce the same bytes for the same token at the same position.
"""

from __future__ import annotations

import ctypes
import gc
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..errors import InputError
from ..model.arch import ARCHITECTURES
from ..model.chat import ChatTemplate
from ..model.config import ModelConfig
from ..model.gguf_file import ModelFile
from ..model.quants import DEQUANT_ROW
from ..model.registry import resolve_model
from ..model.tokenizer import Tokenizer
from ..model.weights import Weights, open_store
from . import kernels, sampler
from .jit import check_target
from .kvcache import KVCache, KVPool, check_kv_fits, kv_bytes_per_number, parse_kv_type
from .linear import Activations, matmul, project
from .precompile import warm
from .threads import forward_pass, set_threads

__all__ = ["DEFAULT_CHUNK", "DEFAULT_N_CTX", "Engine", "check_chunk_size", "set_threads"]

DEFAULT_N_CTX = 4096
DEFAULT_CHUNK = 64  # prefill tokens per forward chunk: any value gives the same bytes
PROGRESS_MARK = "compiling kernels"  # the CLI's status while warm_up runs (the bench checks it at cold start)
GROUP_JOBS = 8  # attention takes a whole GQA group per job from this many (token, KV head) jobs on (same bytes)


def check_chunk_size(chunk_size: int) -> int:
    """``chunk_size`` (prefill tokens per forward chunk) if it is at least 1; InputError otherwise."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise InputError(f"--chunk-size must be at least 1, got {chunk_size!r}")
    return chunk_size


@dataclass
class _Scratch:
    """Activation buffers for a chunk of up to ``T`` tokens, allocated once per chunk size."""

    x: np.ndarray  # [T, n_embd] residual stream
    xn: np.ndarray  # [T, n_embd] normalized
    qkv: np.ndarray  # [T, q_width + 2 kv_width]
    attn: np.ndarray  # [T, q_width]
    proj: np.ndarray  # [T, n_embd]
    gate_up: np.ndarray  # [T, 2 n_ff]
    ffn: np.ndarray  # [T, n_ff]
    q: np.ndarray  # [T, q_width] the queries apart from their gates (attn_output_gate), else [T, 0]
    ssm_in: np.ndarray  # [T, ssm_conv_width + ssm_d_inner + 2 n_v_head] a recurrent layer's projections, else [T, 0]
    ssm_o: np.ndarray  # [T, ssm_d_inner] its output before ssm_out, else [T, 0]
    # 8-bit codes of the matmul inputs: n -> Activations buffers [T, n] (C-contiguous) of inputs of width n;
    # (n, rows.start, rows.stop) -> Activations views of their rows
    codes: dict = field(default_factory=dict)


@contextmanager
def _gc_paused():
    """Loading allocates millions of objects that form no reference cycles (a 262k-token vocabulary, its index,
    its merges): the collections those allocations trigger only re-scan them (~0.15 s of Gemma 3's load)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _trim_heap() -> None:
    """Give the C heap's free pages back to the OS (glibc's ``malloc_trim``; elsewhere nothing). A load frees far
    more than it keeps, most of it the tokenizer build's conversions of a 262k-token vocabulary and its merges, but
    glibc returns only the top of its heap by itself: Gemma 3's peak RSS after a 2048-token prefill fell from 634 to
    613 MB."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):
        pass


class Engine:
    """A model ready to run: file, config, tokenizer, chat template, repacked weights and RoPE tables.

    Construct with :meth:`load`. ``n_ctx`` is the number of positions a KV cache holds; ``kv_type`` "f32" or "f16".
    """

    def __init__(self, model_file: ModelFile, n_ctx: int = DEFAULT_N_CTX, kv_type: str = "f32"):
        self.model_file = model_file
        self.config = cfg = ModelConfig.from_model(model_file)
        if not 1 <= n_ctx <= cfg.n_ctx_train:
            raise InputError(f"--ctx {n_ctx} is out of range; this model supports 1..{cfg.n_ctx_train} positions")
        self.n_ctx = n_ctx
        self.kv_type = parse_kv_type(kv_type)
        check_kv_fits(cfg, n_ctx, self.kv_type)  # before any table of n_ctx rows is built
        # a store of repacked weights is checked in the background while the tokenizer is built
        store = open_store(model_file, cfg)
        self.tokenizer = Tokenizer.from_model(model_file)
        self.chat_template = ChatTemplate.from_model(model_file)
        self.weights = Weights.load(model_file, cfg, store)
        self._embd_row = DEQUANT_ROW[self.weights.token_embd_type]
        arch = ARCHITECTURES[cfg.arch]
        neox, gelu = arch.rope_style == "neox", arch.activation == "gelu_tanh"
        self._rope = kernels.rope_neox if neox else kernels.rope_norm
        self._ffn_act = kernels.geglu if gelu else kernels.swiglu
        # chunks (T > 1) run them token by token in parallel (same bytes: tokens are independent there)
        self._rope_tokens = kernels.rope_neox_tokens if neox else kernels.rope_norm_tokens
        self._ffn_act_tokens = kernels.geglu_tokens if gelu else kernels.swiglu_tokens
        # gemma3 scales embeddings by sqrtf(n_embd) (llama.cpp src/models/gemma3.cpp); None: no scaling.
        self._embd_scale = np.float32(np.sqrt(np.float32(cfg.n_embd))) if arch.embd_scale else None
        # Per layer: (cos, sin) RoPE tables [n_ctx, n_rot / 2] of the layer's base, and its window (0: none). The
        # tables are filled by the first forward pass (_fill_rope), so a cold start compiles their kernel beside
        # the others on two cores (compute/precompile.py) instead of alone before them.
        half = cfg.n_rot // 2
        self._rope_tables = {b: (np.empty((n_ctx, half), np.float32), np.empty((n_ctx, half), np.float32))
                             for b in {cfg.rope_freq_base, cfg.rope_freq_base_swa}}  # fmt: skip
        self._rope_filled = False
        self._layer_rope = [self._rope_tables[cfg.rope_freq_base_swa if swa else cfg.rope_freq_base] for swa in cfg.swa_layers]
        self._layer_window = [cfg.sliding_window if swa else 0 for swa in cfg.swa_layers]
        self.attn_scale = np.float32(1.0 / np.sqrt(np.float64(cfg.query_pre_attn_scalar)))
        self._gated = arch.attn_output_gate
        # per layer, where its state is in a cache: its K/V's index in cache.k / cache.v (attention layers, in
        # order), or its first array's in cache.state (recurrent layers: conv inputs, then the delta-rule state)
        recurrent = cfg.recurrent_layers or (False,) * cfg.n_layer
        self._slot = [2 * sum(recurrent[:il]) if r else il - sum(recurrent[:il]) for il, r in enumerate(recurrent)]
        self._scratch: dict[int, _Scratch] = {}
        self._kv_pool = KVPool()

    @classmethod
    def load(cls, model: str | os.PathLike | None = None, *, n_ctx: int = DEFAULT_N_CTX, kv_type: str = "f32",
             rederive: bool = False) -> "Engine":  # fmt: skip
        """Load a model by registry name or .gguf path (None: the default model).

        ``rederive`` uses no derived file at all: the GGUF's header is parsed, the tokenizer's hash and merge table
        computed and the weights repacked from the GGUF alone, and nothing is read from or written to
        ``$DETINFER_HOME/index`` or the weights store (numba's JIT cache is the caller's: ``--rederive`` in the CLI
        runs with a fresh ``NUMBA_CACHE_DIR``). Without it, every derived file is checked before use and rebuilt
        with a one-line warning if it does not check out. Same bytes either way.

        The KV type is checked before the model is read, so a quantized ``kv_type`` fails fast (KVTypeError), and
        so is ``DETINFER_CPU_LEVEL`` (InputError, see compute/jit.py). Raises DetinferError subclasses for a
        missing/invalid file, unsupported architecture or tensor type.
        """
        parse_kv_type(kv_type)
        check_target()  # a DETINFER_CPU_LEVEL configure() could not use fails here, before anything compiles
        with _gc_paused():
            engine = cls(ModelFile(resolve_model(model), use_index=not rederive), n_ctx=n_ctx, kv_type=kv_type)
        _trim_heap()
        return engine

    def warm_up(self) -> bool:
        """Compile (first run) or load from numba's cache every kernel the engine uses, outside any timing: a 2-token
        chunk, then a 1-token step (numba types a one-row slice as contiguous, so decode has its own specializations).
        Kernels missing from the cache compile on two cores (compute/precompile.py); the same bytes either way.
        True if any kernel compiled, False if all loaded from the cache."""

        def run() -> None:
            self._rope_filled = False  # a dry run of the warm-up (compute/precompile.py) fills nothing: fill anew
            cache = self.new_cache()
            self.forward([0, 0], cache)
            self.forward([0], cache)

        try:
            # the sampler's kernels only when compiling: a warm start loads them when a generation first samples
            return warm(run, [(sampler.warm_up, (self.config.n_vocab,))]) is not None
        except BaseException:
            self._rope_filled = False  # stopped after a dry run: its tables hold nothing
            raise

    def _fill_rope(self) -> None:
        for base, (cos, sin) in self._rope_tables.items():
            kernels.rope_fill(cos, sin, self.config.n_rot, base)
        self._rope_filled = True

    def new_cache(self) -> KVCache:
        """An empty KV cache of n_ctx positions: zeroed memory, that of the last cache dropped if nothing views it
        any more (:class:`KVPool`), else a new mapping whose pages are committed when written."""
        return KVCache(self.config, self.n_ctx, self.kv_type, pool=self._kv_pool)

    def kv_bytes(self, n_positions: int | None = None, kv_type: str | None = None) -> int:
        """KV cache bytes for ``n_positions`` (default n_ctx) with the formula in :class:`KVCache`."""
        return self.config.kv_bytes(self.n_ctx if n_positions is None else n_positions, kv_bytes_per_number(kv_type or self.kv_type))

    def _scratch_for(self, T: int) -> _Scratch:
        if T not in self._scratch:
            cfg = self.config
            qw = cfg.n_head * cfg.head_dim
            f = np.float32
            gate = qw if self._gated else 0
            self._scratch[T] = _Scratch(
                x=np.empty((T, cfg.n_embd), f),
                xn=np.empty((T, cfg.n_embd), f),
                qkv=np.empty((T, qw + gate + 2 * cfg.kv_width), f),
                attn=np.empty((T, qw), f),
                proj=np.empty((T, cfg.n_embd), f),
                gate_up=np.empty((T, 2 * cfg.n_ff), f),
                ffn=np.empty((T, cfg.n_ff), f),
                q=np.empty((T, gate), f),
                ssm_in=np.empty((T, (cfg.ssm_conv_width + cfg.ssm_d_inner + 2 * cfg.ssm_n_v_head) if cfg.state_bytes else 0), f),
                ssm_o=np.empty((T, cfg.ssm_d_inner), f),
            )
        return self._scratch[T]

    @staticmethod
    def _codes(s: _Scratch, x: np.ndarray, rows: slice = slice(None)) -> Activations:
        """The 8-bit block codes of a matmul input x (float32 [T', n]; rows: which scratch rows it fills), in views
        made once per (n, rows) (decode would otherwise rebuild them for every matmul) of C-contiguous buffers of
        width n: views of one buffer of the widest input would be non-contiguous for some widths, and every
        kernel taking them would compile once per layout."""
        n = x.shape[1]
        a = s.codes.get((n, rows.start, rows.stop))
        if a is None:
            if n not in s.codes:
                s.codes[n] = Activations.empty(s.x.shape[0], n)
            a = s.codes[(n, rows.start, rows.stop)] = Activations(*(b[rows] for b in s.codes[n]))
        (kernels.quantize_blocks_tokens if x.shape[0] > 1 else kernels.quantize_blocks)(x, *a)
        return a

    def forward(
        self, tokens: Sequence[int], cache: KVCache, *, all_logits: bool = False, chunk_size: int = DEFAULT_CHUNK
    ) -> np.ndarray:
        """Run ``tokens`` at positions cache.n_tokens.. and append their K/V to ``cache``.

        Returns float32 logits [len(tokens), n_vocab] if ``all_logits``, else [n_vocab] for the last token.
        ``chunk_size`` (>= 1) only splits the work; it never changes a bit of the result.
        Raises InputError for an empty or out-of-vocabulary token list, or one that does not fit in the cache.
        """
        ids = self._checked_ids(tokens, cache)
        n = ids.shape[0]
        check_chunk_size(chunk_size)
        logits = np.empty((n if all_logits else 1, self.config.n_vocab), np.float32)
        for start in range(0, n, chunk_size):
            chunk = ids[start : start + chunk_size]
            T = chunk.shape[0]
            last = start + T == n
            with forward_pass():
                if all_logits:
                    self._forward_chunk(chunk, [(cache, T)], logits[start : start + T], slice(0, T))
                else:
                    self._forward_chunk(chunk, [(cache, T)], logits if last else None, slice(T - 1, T))
        return logits if all_logits else logits[0]

    def forward_batch(self, batch: Sequence[tuple[Sequence[int], KVCache, bool]]) -> list[np.ndarray]:
        """One forward step over several sequences: for each ``(tokens, cache, all_logits)``, run ``tokens`` at
        positions cache.n_tokens.. of its own cache and append their K/V there, exactly as
        ``forward(tokens, cache, all_logits=all_logits)`` alone would, byte for byte, whatever runs beside it
        (decode rows, prefill chunks and draft windows mixed, in any order). Every row goes through the same
        per-row kernels and matmuls (which parallelise over independent outputs only); attention runs per sequence
        over its own cache. No chunking: the whole batch is one step.

        Returns, per entry, float32 logits [len(tokens), n_vocab] if its ``all_logits``, else [n_vocab].
        Raises InputError for an empty batch, a cache given twice, or an entry ``forward`` would refuse.
        """
        if not batch:
            raise InputError("an empty batch has nothing to run")
        if len({id(cache) for _, cache, _ in batch}) != len(batch):
            raise InputError("a batch gives one KV cache twice; each sequence needs its own")
        ids = [self._checked_ids(tokens, cache) for tokens, cache, _ in batch]
        rows, start = [], 0
        for seq, (_, _, all_logits) in zip(ids, batch):
            rows.extend(range(start, start + len(seq)) if all_logits else [start + len(seq) - 1])
            start += len(seq)
        logits = np.empty((len(rows), self.config.n_vocab), np.float32)
        with forward_pass():
            self._forward_chunk(np.concatenate(ids), [(cache, len(seq)) for seq, (_, cache, _) in zip(ids, batch)],
                                logits, np.asarray(rows, dtype=np.int64))  # fmt: skip
        out, at = [], 0
        for seq, (_, _, all_logits) in zip(ids, batch):
            k = len(seq) if all_logits else 1
            out.append(logits[at : at + k] if all_logits else logits[at])
            at += k
        return out

    def _ffn(self, layer, s: _Scratch, norm, ffn_act, eps: np.float32) -> None:
        """The FFN block of ``layer`` on the residual stream s.x, in place (with gemma3's post-FFN norm)."""
        norm(s.x, layer.ffn_norm, eps, s.xn)
        project(layer.ffn_gate_up, s.xn, self._codes(s, s.xn), s.gate_up)
        ffn_act(s.gate_up, s.ffn)
        project(layer.ffn_down, s.ffn, self._codes(s, s.ffn), s.proj)
        if layer.post_ffw_norm is not None:
            norm(s.proj, layer.post_ffw_norm, eps, s.proj)
        kernels.add_inplace(s.x, s.proj)

    def _checked_ids(self, tokens: Sequence[int], cache: KVCache) -> np.ndarray:
        """``tokens`` as int64 ids; InputError if empty, outside the vocabulary or beyond the cache's context."""
        cfg = self.config
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        n = ids.shape[0]
        if n == 0:
            raise InputError("no tokens to run")
        if ids.min() < 0 or ids.max() >= cfg.n_vocab:
            bad = int(ids[(ids < 0) | (ids >= cfg.n_vocab)][0])
            raise InputError(f"token id {bad} is outside the vocabulary (0..{cfg.n_vocab - 1})")
        if cache.n_tokens + n > cache.n_ctx:
            raise InputError(
                f"{cache.n_tokens} cached + {n} new tokens exceed the context of {cache.n_ctx}; raise --ctx or shorten the prompt"
            )
        return ids

    def _forward_chunk(self, ids: np.ndarray, segments: list[tuple[KVCache, int]], logits: np.ndarray | None,
                       rows: slice | np.ndarray) -> None:  # fmt: skip
        """One chunk through every layer: the llama block (Touvron et al. 2023, as llama.cpp runs GGUF llama files)
        with the optional steps of the architecture (detinfer/arch.py): q/k/v bias, per-head q/k norm, RoPE style
        and base per layer, sliding-window layers, post-attention / post-FFN norms, FFN activation.

        ``ids`` holds the tokens of every segment in order; segment (cache, n) takes the next n rows, at positions
        cache.n_tokens.. of its cache. ``logits`` (if given) receives the logits of the chunk's ``rows``.
        """
        cfg, w = self.config, self.weights
        if not self._rope_filled:
            self._fill_rope()
        T = ids.shape[0]
        s = self._scratch_for(T)
        spans, a = [], 0  # (cache, first row, row end, first position) per segment
        for cache, n in segments:
            spans.append((cache, a, a + n, cache.n_tokens))
            cache.will_write(cache.n_tokens + n)
            a += n
        positions = np.concatenate([np.arange(p0, p0 + (b - a), dtype=np.int64) for _, a, b, p0 in spans])
        qw, kvw = cfg.n_head * cfg.head_dim, cfg.kv_width
        eps = np.float32(cfg.rms_norm_eps)
        chunk = T > 1  # per-token kernels: tokens in parallel for a chunk, plain calls for one token
        norm = kernels.rmsnorm_tokens if chunk else kernels.rmsnorm
        norm_heads = kernels.rmsnorm_heads_tokens if chunk else kernels.rmsnorm_heads
        rope = self._rope_tokens if chunk else self._rope
        ffn_act = self._ffn_act_tokens if chunk else self._ffn_act
        for t in range(T):
            self._embd_row(w.token_embd[ids[t]], s.x[t])
        if self._embd_scale is not None:
            s.x *= self._embd_scale  # one float32 multiply per element
        for li, layer in enumerate(w.layers):
            norm(s.x, layer.attn_norm, eps, s.xn)
            slot = self._slot[li]
            if layer.recurrent:  # each sequence's recurrence on its own state, as if it ran alone
                project(layer.ssm_in, s.xn, self._codes(s, s.xn), s.ssm_in)
                for cache, a, b, _ in spans:
                    kernels.delta_net(s.ssm_in[a:b], layer.ssm_conv1d, layer.ssm_dt_bias, layer.ssm_a, layer.ssm_norm,
                                      cache.state[slot], cache.state[slot + 1], cfg.ssm_n_k_head, eps, s.ssm_o[a:b])  # fmt: skip
                project(layer.ssm_out, s.ssm_o, self._codes(s, s.ssm_o), s.proj)
                kernels.add_inplace(s.x, s.proj)
                self._ffn(layer, s, norm, ffn_act, eps)
                continue
            project(layer.attn_qkv, s.xn, self._codes(s, s.xn), s.qkv)
            if layer.attn_qkv_bias is not None:
                kernels.add_bias(s.qkv, layer.attn_qkv_bias)
            if self._gated:  # rows [q_h | gate_h] per head: the queries apart, the gates read in place after attention
                s.q.reshape(T, cfg.n_head, cfg.head_dim)[...] = s.qkv[:, : 2 * qw].reshape(T, cfg.n_head, 2, cfg.head_dim)[:, :, 0]
                queries, k_col = s.q, 2 * qw
            else:
                queries, k_col = s.qkv, qw
            q, k = queries[:, :qw], s.qkv[:, k_col : k_col + kvw]
            if layer.attn_q_norm is not None:
                norm_heads(q.reshape(T, cfg.n_head, cfg.head_dim), layer.attn_q_norm, eps)
                norm_heads(k.reshape(T, cfg.n_head_kv, cfg.head_dim), layer.attn_k_norm, eps)
            cos, sin = self._layer_rope[li]
            rope(q, positions, cfg.n_head, cfg.head_dim, cos, sin)
            rope(k, positions, cfg.n_head_kv, cfg.head_dim, cos, sin)
            for cache, a, b, p0 in spans:  # each sequence's attention over its own cache, as if it ran alone
                n = b - a
                kv_write = kernels.kv_write_tokens if n > 1 else kernels.kv_write
                kv_write(cache.k[slot], cache.v[slot], s.qkv[a:b], k_col, k_col + kvw, p0)
                heads_per_job = cfg.n_head // cfg.n_head_kv if n * cfg.n_head_kv >= GROUP_JOBS else 1
                kernels.attention(queries[a:b], cache.k[slot], cache.v[slot], p0, cfg.n_head, self.attn_scale, cache.lut,
                                  s.attn[a:b], self._layer_window[li], heads_per_job)  # fmt: skip
            if self._gated:
                kernels.gate_heads(s.attn, s.qkv, cfg.n_head, cfg.head_dim)
            project(layer.attn_output, s.attn, self._codes(s, s.attn), s.proj)
            if layer.post_attention_norm is not None:
                norm(s.proj, layer.post_attention_norm, eps, s.proj)
            kernels.add_inplace(s.x, s.proj)
            self._ffn(layer, s, norm, ffn_act, eps)
        for cache, a, b, p0 in spans:
            cache.tokens.extend(int(i) for i in ids[a:b])
            cache.forwarded(p0)
        if logits is None:
            return
        if isinstance(rows, np.ndarray):  # rows of several segments: gathered into the first scratch rows
            k = rows.shape[0]
            x, rows = s.x[rows], slice(0, k)
        else:
            x = s.x[rows]
        xn = s.xn[rows]
        kernels.rmsnorm(x, w.output_norm, eps, xn)
        matmul(w.output, xn, self._codes(s, xn, rows), logits)

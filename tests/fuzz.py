"""Offline fuzzing of every input detinfer reads: ``python tests/fuzz.py --examples N --report docs/reliability.md``.

The contract under test: any input ends in a correct result or a typed ``DetinferError`` with a one-line message,
never another exception and never a crash. Inputs are valid files written by detinfer itself (a tiny synthetic
GGUF model from tests/gguf_factory.py, a run manifest, a session script and record, a .detkv snapshot), then
mutated by hypothesis strategies: truncation at section boundaries and anywhere, bit flips, huge counts and
lengths, moved tensor offsets and dims, JSON edits and type changes, random chat templates.

Each target runs in a worker process with ``NUMBA_BOUNDSCHECK=1`` (and its own numba cache), so a shape that would
make a kernel read out of bounds shows up as an ``IndexError`` ("other exception") instead of silently reading
garbage, and a worker that dies is counted as a crash and restarted with the next seed. tests/test_fuzz.py runs
the same targets in-process with a few hundred examples each.

A developer tool beside the tests, not part of the installed package: it needs the dev extra (hypothesis).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import queue
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from detinfer.errors import DetinferError

TESTS_DIR = Path(__file__).resolve().parent
OK, REJECTED, BAD_MESSAGE, OTHER, CRASH, HANG = "ok", "DetinferError", "DetinferError, not one line", "other exception", "crash", "hang"
OUTCOMES = (OK, REJECTED, BAD_MESSAGE, OTHER, CRASH, HANG)
HANG_S = 60.0  # an input that keeps its worker silent this long is a hang: the worker is killed and restarted


def classify(fn: Callable[[], Any]) -> tuple[str, str]:
    """Run ``fn``: (outcome, detail). A DetinferError must carry a non-empty one-line message."""
    try:
        fn()
    except DetinferError as e:
        msg = str(e)
        if not msg.strip() or "\n" in msg or "\r" in msg:
            return BAD_MESSAGE, f"{type(e).__name__}: {msg!r}"
        return REJECTED, f"{type(e).__name__}: {msg[:200]}"
    except Exception as e:  # the thing we hunt for
        return OTHER, f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
    return OK, ""


# ------------------------------------------------------------------------------------------ corpus (valid inputs)


def _factory():
    import gguf_factory  # beside this file, so on sys.path both under pytest and as a script

    return gguf_factory


@dataclass
class Corpus:
    """Valid inputs written once into ``folder``; every mutation starts from one of them."""

    folder: Path
    gguf: dict[str, bytes] = field(default_factory=dict)  # variant name -> file bytes
    gguf_fields: dict[str, "GGUFFields"] = field(default_factory=dict)
    manifest: dict = field(default_factory=dict)
    session: dict = field(default_factory=dict)
    script: dict = field(default_factory=dict)
    detkv: bytes = b""
    snapshot: str = ""  # the run's token stream as a pytest snapshot stores it (canonical JSON)
    http: list[dict] = field(default_factory=list)  # valid request bodies: (path, body) as {"path": ..., "body": ...}
    engine: Any = None  # the tiny model's engine, shared by the HTTP target's app
    cache: Any = None  # the cache target's CacheCorpus, built on first use
    _client: Any = None


def gguf_variants(folder: Path) -> dict[str, Path]:
    """Structurally different tiny models: valid ones (several tensor types; llama, qwen2, qwen3 and gemma3), and
    ones whose metadata or shapes are wrong for their architecture (types changed, huge or zero values, wrong
    alignment, wrong dims, a missing bias, norm or sliding window)."""
    f = _factory()
    from gguf import GGUFValueType as V

    cfg = f.TinyConfig(n_embd=64, n_layer=1, n_head=4, n_head_kv=2, n_ff=64)
    out: dict[str, Path] = {}
    folder.mkdir(parents=True, exist_ok=True)

    def w(name: str, **kw: Any) -> None:
        kw.setdefault("config", cfg)
        out[name] = f.write_tiny_gguf(folder / f"{name}.gguf", chat_template=f.CHATML, **kw)

    w("valid-f32")
    w("valid-q4_1", matrix_type="Q4_1")
    w("valid-q8_0-untied", matrix_type="Q8_0", tied=False)
    w("valid-mixed", matrix_type="Q4_0", types={"token_embd.weight": "F16", "blk.0.ffn_down.weight": "Q8_0"})
    w("unsupported-type", matrix_type="Q4_1", types={"blk.0.attn_q.weight": "IQ4_NL"})
    # other architectures with their own tiny configs; k-quant rows need n_in % 256 == 0 (zero-filled blocks)
    w("valid-qwen2", architecture="qwen2", config=None, matrix_type="Q8_0")
    w("valid-qwen3", architecture="qwen3", config=None, matrix_type="Q5_0")
    w("valid-gemma3", architecture="gemma3", config=None, matrix_type="Q5_1")
    w("valid-kquants", config=f.TinyConfig(n_embd=256, n_layer=1, n_head=4, n_head_kv=2, n_ff=256), matrix_type="Q4_K",
      types={"blk.0.ffn_down.weight": "Q6_K", "blk.0.attn_v.weight": "Q5_K", "token_embd.weight": "Q6_K"})
    w("qwen2-bias-missing", architecture="qwen2", config=None, drop_tensors=("blk.0.attn_k.bias",))
    w("qwen3-norm-wrong", architecture="qwen3", config=None, shapes={"blk.1.attn_q_norm.weight": (16,)})
    w("gemma3-window-missing", architecture="gemma3", config=None, drop_metadata=("gemma3.attention.sliding_window",))
    w("gemma3-window-huge", architecture="gemma3", config=None, extra_metadata={"gemma3.attention.sliding_window": (2**63, V.UINT64)})
    w("gemma3-softcap", architecture="gemma3", config=None, extra_metadata={"gemma3.final_logit_softcapping": (30.0, V.FLOAT32)})
    w("head-count-as-string", extra_metadata={"llama.attention.head_count": ("4", V.STRING)})
    w("embd-as-float", extra_metadata={"llama.embedding_length": (64.5, V.FLOAT32)})
    w("block-count-array", extra_metadata={"llama.block_count": ([1, 2], V.ARRAY)})
    w("ff-negative", extra_metadata={"llama.feed_forward_length": (-64, V.INT32)})
    w("ctx-huge", extra_metadata={"llama.context_length": (2**63, V.UINT64)})
    w("head-count-zero", extra_metadata={"llama.attention.head_count": (0, V.UINT32)})
    w("head-kv-huge", extra_metadata={"llama.attention.head_count_kv": (2**32 - 1, V.UINT32)})
    w("key-length-odd", extra_metadata={"llama.attention.key_length": (15, V.UINT32)})
    w("key-length-wrong", extra_metadata={"llama.attention.key_length": (32, V.UINT32)})
    w("eps-nan", extra_metadata={"llama.attention.layer_norm_rms_epsilon": (float("nan"), V.FLOAT32)})
    w("rope-base-zero", extra_metadata={"llama.rope.freq_base": (0.0, V.FLOAT32)})
    w("vocab-size-wrong", extra_metadata={"llama.vocab_size": (1000, V.UINT32)})
    w("eos-out-of-vocab", extra_metadata={"tokenizer.ggml.eos_token_id": (10**6, V.UINT32)})
    w("template-not-text", extra_metadata={"tokenizer.chat_template": (7, V.UINT32)})
    w("tokens-not-strings", extra_metadata={"tokenizer.ggml.tokens": ([1, 2, 3], V.ARRAY)})
    w("arch-unknown", architecture="qwen9")
    for align in (0, 1, 3, 7, 2**31):
        w(f"alignment-{align}", extra_metadata={"general.alignment": (align, V.UINT32)})
    w("dims-q-transposed", shapes={"blk.0.attn_q.weight": (64, 64 + 32)})
    w("dims-k-short", shapes={"blk.0.attn_k.weight": (16, 64)})
    w("dims-embd-1d", shapes={"token_embd.weight": (299 * 64,)})
    w("dims-norm-2d", shapes={"output_norm.weight": (2, 32)})
    w("dims-ffn-down-wrong", shapes={"blk.0.ffn_down.weight": (64, 32)})
    w("missing-tensor", drop_tensors=("blk.0.attn_v.weight",))
    w("missing-metadata", drop_metadata=("llama.embedding_length",))
    w("missing-tokenizer", drop_metadata=("tokenizer.ggml.tokens",))
    return out


@dataclass
class GGUFFields:
    """Byte offsets inside a GGUF file: section boundaries and integer fields worth corrupting."""

    boundaries: list[int]  # start of every KV pair and tensor info, of the data section, and the end
    ints: list[tuple[int, int]]  # (offset, width) of counts, lengths, type ids, dims and offsets
    tensor_offsets: list[int]  # offset of each tensor info's u64 data offset (relative to the data section)
    tensor_dims: list[list[int]]  # offsets of each tensor's u64 dims
    tensor_types: list[int]  # offset of each tensor's u32 type
    data_start: int
    regions: dict[str, tuple[int, int]]


_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def gguf_fields(data: bytes) -> GGUFFields:
    """Walk a valid GGUF (v3, little-endian) and record where its fields are (spec: ggml docs/gguf.md)."""
    pos = 0

    def u(fmt: str) -> int:
        nonlocal pos
        (v,) = struct.unpack_from("<" + fmt, data, pos)
        pos += struct.calcsize(fmt)
        return v

    ints: list[tuple[int, int]] = [(4, 4), (8, 8), (16, 8)]
    pos = 8
    n_tensors, n_kv = u("Q"), u("Q")
    boundaries = [0, 4, 8, 16, 24]
    alignment = 32

    def value(vtype: int) -> Any:
        nonlocal pos
        if vtype == 8:
            ints.append((pos, 8))
            n = u("Q")
            s = data[pos : pos + n]
            pos += n
            return s
        if vtype == 9:
            ints.append((pos, 4))
            sub = u("I")
            ints.append((pos, 8))
            n = u("Q")
            for _ in range(n):
                value(sub)
            return None
        size = _SCALAR_SIZES[vtype]
        if vtype in (4, 5, 10, 11):
            ints.append((pos, size))
        v = int.from_bytes(data[pos : pos + size], "little")
        pos += size
        return v

    for _ in range(n_kv):
        boundaries.append(pos)
        ints.append((pos, 8))
        klen = u("Q")
        key = data[pos : pos + klen]
        pos += klen
        ints.append((pos, 4))
        v = value(u("I"))
        if key == b"general.alignment" and isinstance(v, int) and v > 0:
            alignment = v
    infos_start = pos
    offsets, dims, types = [], [], []
    for _ in range(n_tensors):
        boundaries.append(pos)
        ints.append((pos, 8))
        nlen = u("Q")
        pos += nlen
        ints.append((pos, 4))
        nd = u("I")
        dims.append([pos + 8 * i for i in range(nd)])
        ints.extend((pos + 8 * i, 8) for i in range(nd))
        pos += 8 * nd
        types.append(pos)
        ints.append((pos, 4))
        pos += 4
        offsets.append(pos)
        ints.append((pos, 8))
        pos += 8
    boundaries.append(pos)
    data_start = -(-pos // alignment) * alignment
    boundaries += [data_start, len(data)]
    regions = {"header": (0, 24), "metadata": (24, infos_start), "tensor infos": (infos_start, pos), "data": (data_start, len(data))}
    return GGUFFields(sorted(set(boundaries)), ints, offsets, dims, types, data_start, regions)


def build_corpus(folder: Path) -> Corpus:
    """Write every valid input once (the tiny model, a manifest, a session, a .detkv) and read them back as bytes."""
    from detinfer.compute.engine import Engine
    from detinfer.compute.sampling import Sampling, SamplingOverrides
    from detinfer.model.gguf_file import ModelFile
    from detinfer.records.kvfile import save_kv
    from detinfer.records.manifest import write_manifest
    from detinfer.records.run import build_prompt, execute
    from detinfer.records.session import ScriptTurn, run_session, write_session
    from detinfer.records.tokenstream import run_stream, stream_json

    folder.mkdir(parents=True, exist_ok=True)
    corpus = Corpus(folder)
    for name, path in gguf_variants(folder / "gguf").items():
        corpus.gguf[name] = path.read_bytes()
        if name.startswith("valid"):
            corpus.gguf_fields[name] = gguf_fields(corpus.gguf[name])
    base = next(iter(gguf_variants_valid_paths(folder)))
    engine = corpus.engine = Engine(ModelFile(base, use_index=False), n_ctx=64)
    prompt = build_prompt(engine, messages=[{"role": "user", "content": "hi there"}], chat=True)
    sampling = Sampling(temperature=0.8, top_k=40, top_p=0.9, min_p=0.0, repetition_penalty=1.1, repeat_last_n=64,
                              seed=7, max_tokens=4, stop=["."], ignore_eos=False)  # fmt: skip
    run = execute(engine, prompt, sampling)
    write_manifest(run, folder / "run.json")
    corpus.snapshot = stream_json(run_stream(run))
    corpus.manifest = json.loads((folder / "run.json").read_text())
    turns = [ScriptTurn(messages=[{"role": "user", "content": "hi"}]), ScriptTurn(messages=[{"role": "user", "content": "the cat"}])]
    record = run_session(engine, turns, SamplingOverrides(temperature=0.7, seed=11, max_tokens=3), kv_dir=folder / "kv")
    write_session(record, folder / "session.json")
    corpus.session = json.loads((folder / "session.json").read_text())
    corpus.script = {"model": "tiny", "sampling": {"temperature": 0.7, "top_p": 0.9, "seed": 11, "max_tokens": 12},
                     "turns": [{"messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2 + 3?"}]},
                               {"messages": [{"role": "tool", "content": "{\"r\": 5}"}], "sampling": {"temperature": 0}}]}  # fmt: skip
    corpus.detkv = (folder / "kv" / "turn-002.detkv").read_bytes()
    msgs = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"}]
    corpus.http = [
        {"path": "/v1/chat/completions", "body": {"model": "x", "messages": msgs, "max_tokens": 4, "seed": 3}},
        {"path": "/v1/chat/completions", "body": {"model": "x", "messages": msgs, "max_tokens": 3, "stream": True, "temperature": 0.5,
                                                  "top_p": 0.9, "logprobs": True, "top_logprobs": 2, "stop": ["."],
                                                  "stream_options": {"include_usage": True}}},
        {"path": "/v1/completions", "body": {"model": "x", "prompt": "the cat", "max_tokens": 3, "logprobs": 1, "echo": False}},
    ]  # fmt: skip
    cache = engine.new_cache()
    engine.forward([1, 2, 3], cache)
    save_kv(folder / "three.detkv", cache, model_sha256=engine.model_file.sha256, tokenizer_sha256=engine.tokenizer.hash)
    return corpus


def gguf_variants_valid_paths(folder: Path) -> list[Path]:
    return [folder / "gguf" / "valid-f32.gguf"]


# ------------------------------------------------------------------------------------------ strategies and checks

INTERESTING = (0, 1, 2, 3, 7, 31, 32, 33, 63, 64, 255, 2**15, 2**16 - 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40,
               2**62, 2**63 - 1, 2**63, 2**64 - 1)  # fmt: skip


def _st():
    from hypothesis import strategies as st

    return st


def gguf_strategy(corpus: Corpus):
    """(variant, ops): a model variant and 0-3 byte-level mutations of it (applied by :func:`apply_gguf_ops`)."""
    st = _st()
    valid = sorted(corpus.gguf_fields)
    integer = st.one_of(st.sampled_from(INTERESTING), st.integers(0, 2**64 - 1))

    @st.composite
    def op(draw, name: str):
        f = corpus.gguf_fields[name]
        size = len(corpus.gguf[name])
        kind = draw(st.sampled_from(["truncate", "truncate-boundary", "flip", "int", "offset", "dims", "type", "ndims"]))
        if kind == "truncate":
            return ("truncate", draw(st.integers(0, size - 1)))
        if kind == "truncate-boundary":
            return ("truncate", max(0, draw(st.sampled_from(f.boundaries)) + draw(st.integers(-2, 2))))
        if kind == "flip":
            region = draw(st.sampled_from(sorted(f.regions)))
            a, b = f.regions[region]
            return ("flip", draw(st.integers(a, max(a, b - 1))), draw(st.integers(0, 7)))
        if kind == "int":
            pos, width = draw(st.sampled_from(f.ints))
            return ("int", pos, width, draw(integer))
        i = draw(st.integers(0, len(f.tensor_offsets) - 1))
        if kind == "offset":
            choice = draw(st.sampled_from(["other", "end", "past-end", "misaligned", "huge", "random"]))
            rel = {
                "other": lambda: struct.unpack_from("<Q", corpus.gguf[name], draw(st.sampled_from(f.tensor_offsets)))[0],
                "end": lambda: size - f.data_start,
                "past-end": lambda: size - f.data_start + draw(st.integers(1, 4096)),
                "misaligned": lambda: struct.unpack_from("<Q", corpus.gguf[name], f.tensor_offsets[i])[0] + draw(st.integers(1, 31)),
                "huge": lambda: draw(st.sampled_from((2**63 - 1, 2**64 - 1, 2**62))),
                "random": lambda: draw(st.integers(0, 2**64 - 1)),
            }[choice]()
            return ("int", f.tensor_offsets[i], 8, rel)
        if kind == "dims":
            if not f.tensor_dims[i]:
                return ("truncate", size)
            return ("int", draw(st.sampled_from(f.tensor_dims[i])), 8, draw(st.one_of(st.sampled_from(INTERESTING), st.integers(0, 600))))
        if kind == "type":
            return ("int", f.tensor_types[i], 4, draw(st.one_of(st.integers(0, 40), st.sampled_from(INTERESTING))))
        return ("int", f.tensor_dims[i][0] - 4 if f.tensor_dims[i] else f.tensor_types[i] - 4, 4, draw(st.sampled_from((0, 1, 3, 4, 5, 2**31, 2**32 - 1))))

    @st.composite
    def case(draw):
        if draw(st.integers(0, 4)) == 0:  # a structurally wrong model, as written
            return (draw(st.sampled_from(sorted(corpus.gguf))), ())
        name = draw(st.sampled_from(valid))
        return (name, tuple(draw(st.lists(op(name), min_size=1, max_size=3))))

    return case()


def apply_gguf_ops(data: bytes, ops) -> bytes:
    buf = bytearray(data)
    for o in ops:
        if o[0] == "truncate":
            del buf[o[1] :]
        elif o[0] == "flip" and o[1] < len(buf):
            buf[o[1]] ^= 1 << o[2]
        elif o[0] == "int" and o[1] + o[2] <= len(buf):
            buf[o[1] : o[1] + o[2]] = (o[3] % (1 << (8 * o[2]))).to_bytes(o[2], "little")
    return bytes(buf)


def check_gguf(corpus: Corpus, case, path: Path) -> None:
    """Load the (mutated) model, build the engine and run a 2-token forward: must succeed or raise DetinferError."""
    from detinfer.compute.engine import Engine
    from detinfer.model.gguf_file import ModelFile

    name, ops = case
    path.write_bytes(apply_gguf_ops(corpus.gguf[name], ops))
    engine = Engine(ModelFile(path, use_index=False), n_ctx=32)
    logits = engine.forward([1, 2] if engine.config.n_vocab > 2 else [0, 0], engine.new_cache())
    if logits.shape != (engine.config.n_vocab,):
        raise AssertionError(f"logits shape {logits.shape}")


_JSON_LEAVES = (None, True, False, 0, -1, 1, 2**31, 2**63, 2**64, -(2**63) - 1, 1.5, -0.0, float("inf"), float("nan"), 1e308,
                "", "x", "f32", "q4_0", "0" * 64, "\u0000", "\ud7ff\U0001f600", [], {}, [1, 2], {"a": 1})  # fmt: skip


def _paths(data: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(data, dict):
        for k, v in data.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(data, list):
        for i, v in enumerate(data[:8]):
            out += _paths(v, prefix + (i,))
    return out


def json_strategy(base: dict):
    """(edits, reseal, text_ops): JSON edits at random paths (replace with another type, delete, add a key),
    whether to recompute a manifest's section hashes after editing, and byte edits of the serialized text."""
    st = _st()
    paths = _paths(base)
    leaf = st.one_of(st.sampled_from(_JSON_LEAVES), st.integers(), st.floats(), st.text(max_size=20))
    edit = st.tuples(st.sampled_from(["set", "delete", "add"]), st.sampled_from(paths), leaf)
    text_op = st.one_of(
        st.tuples(st.just("truncate"), st.integers(0, 10**6)),
        st.tuples(st.just("flip"), st.integers(0, 10**6), st.integers(0, 7)),
    )
    return st.tuples(st.lists(edit, max_size=3), st.booleans(), st.lists(text_op, max_size=1))


def apply_json_ops(base: dict, case, reseal: Callable[[dict], dict] | None) -> bytes:
    edits, do_reseal, text_ops = case
    data = apply_json_edits(base, edits)
    if do_reseal and reseal is not None and isinstance(data, dict):
        data = reseal(data)
    raw = bytearray(json.dumps(data, sort_keys=True, indent=2, ensure_ascii=False, allow_nan=True).encode("utf-8", "surrogatepass"))
    for op in text_ops:
        if raw and op[0] == "truncate":
            del raw[op[1] % len(raw) :]
        elif raw and op[0] == "flip":
            raw[op[1] % len(raw)] ^= 1 << op[2]
    return bytes(raw)


def apply_json_edits(base: Any, edits) -> Any:
    """A copy of ``base`` with :func:`json_strategy`'s edits (set, delete, add at a path) applied."""
    data = copy.deepcopy(base)
    for kind, path, value in edits:
        value = copy.deepcopy(value)  # hypothesis reuses leaf objects: inserting one list twice would nest it in itself
        if not path:
            data = value if kind == "set" else data
            continue
        parent = data
        try:
            for p in path[:-1]:
                parent = parent[p]
            key = str(path[-1]) if isinstance(parent, dict) else path[-1]  # JSON object keys are strings
            if kind == "set":
                parent[key] = value
            elif kind == "delete":
                del parent[key]
            elif isinstance(parent, dict):
                parent[f"extra_{len(parent)}"] = value
            elif isinstance(parent, list):
                parent.append(value)
        except (KeyError, IndexError, TypeError):
            pass  # an earlier edit removed or retyped the path
    return data


def reseal_manifest(data: dict) -> dict:
    """Recompute token and section hashes so the edit reaches schema validation instead of the tamper check."""
    import hashlib

    from detinfer.records.manifest import CONTRACT_FIELDS, canonical_json, tokens_sha256

    for sec in ("prompt", "output"):
        s = data.get(sec)
        if isinstance(s, dict) and isinstance(s.get("token_ids"), list):
            try:
                s["tokens_sha256"] = tokens_sha256(s["token_ids"])
            except TypeError:
                pass
    try:
        data["section_sha256"] = {k: hashlib.sha256(canonical_json(data.get(k)).encode()).hexdigest() for k in CONTRACT_FIELDS}
    except (TypeError, ValueError):
        pass
    return data


def check_manifest(corpus: Corpus, case, path: Path) -> None:
    from detinfer.records.manifest import load_manifest

    path.write_bytes(apply_json_ops(corpus.manifest, case, reseal_manifest))
    load_manifest(path)


def check_session(corpus: Corpus, case, path: Path) -> None:
    from detinfer.records.session import load_session

    path.write_bytes(apply_json_ops(corpus.session, case, None))
    load_session(path)


def check_script(corpus: Corpus, case, path: Path) -> None:
    from detinfer.records.session import load_script

    path.write_bytes(apply_json_ops(corpus.script, case, None))
    load_script(path)


def detkv_strategy(corpus: Corpus):
    """(header edits, byte ops, fix checksum): edits of the JSON header, flips/truncations/int overwrites of the
    bytes, and whether to recompute the trailing sha256 so the edit reaches the header and length checks."""
    st = _st()
    header = _detkv_header(corpus.detkv)[0]
    keys = sorted(header)
    hval = st.one_of(st.sampled_from(_JSON_LEAVES), st.sampled_from((0, 1, 2, 16, 64, 2**31, 2**62, -1)), st.lists(st.integers(-1, 400), max_size=6))
    hedit = st.tuples(st.sampled_from(keys + ["extra"]), st.sampled_from(["set", "delete"]), hval)
    size = len(corpus.detkv)
    byte_op = st.one_of(
        st.tuples(st.just("truncate"), st.one_of(st.integers(0, size), st.sampled_from((0, 8, 12, 20, 52, size - 32, size - 1)))),
        st.tuples(st.just("flip"), st.integers(0, size - 1), st.integers(0, 7)),
        st.tuples(st.just("int"), st.sampled_from((8, 12)), st.sampled_from(INTERESTING)),
    )
    return st.tuples(st.lists(hedit, max_size=2), st.lists(byte_op, max_size=2), st.booleans())


def _detkv_header(data: bytes) -> tuple[dict, int]:
    from detinfer.records.kvfile import PRELUDE

    _, _, n = PRELUDE.unpack_from(data, 0)
    return json.loads(data[PRELUDE.size : PRELUDE.size + n]), n


def apply_detkv_ops(data: bytes, case) -> bytes:
    import hashlib

    from detinfer.records.kvfile import ALIGN, FORMAT_VERSION, MAGIC, PRELUDE

    hedits, byte_ops, fix = case
    header, n = _detkv_header(data)
    body = data[-(-(PRELUDE.size + n) // ALIGN) * ALIGN : -32]
    for key, kind, value in hedits:
        if kind == "set":
            header[key] = value
        else:
            header.pop(key, None)
    head = json.dumps(header, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()
    pad = bytes(-(-(PRELUDE.size + len(head)) // ALIGN) * ALIGN - PRELUDE.size - len(head))
    buf = bytearray(PRELUDE.pack(MAGIC, FORMAT_VERSION, len(head)) + head + pad + body)
    for op in byte_ops:
        if op[0] == "truncate":
            del buf[op[1] :]
        elif op[0] == "flip" and op[1] < len(buf):
            buf[op[1]] ^= 1 << op[2]
        elif op[0] == "int":
            width = 4 if op[1] == 8 else 8
            buf[op[1] : op[1] + width] = (op[2] % (1 << (8 * width))).to_bytes(width, "little")
    return bytes(buf + (hashlib.sha256(buf).digest() if fix else data[-32:]))


def check_detkv(corpus: Corpus, case, path: Path) -> None:
    from detinfer.records.kvfile import inspect_kv, load_kv

    path.write_bytes(apply_detkv_ops(corpus.detkv, case))
    outcome = classify(lambda: inspect_kv(path))
    load_kv(path)  # load is stricter than inspect: it may fail where inspect succeeded, never the other way round
    if outcome[0] != OK:
        raise AssertionError(f"load_kv accepted a file inspect_kv refused ({outcome[1]})")


TEMPLATE_PARTS = (
    "{% for message in messages %}", "{% endfor %}", "{{ message['role'] }}", "{{ message.content }}", "<|im_start|>",
    "{% if add_generation_prompt %}", "{% endif %}", "{% else %}", "{{ messages[0]['content'] | trim }}",
    "{{ bos_token }}", "{{ eos_token }}", "{{ raise_exception('no') }}", "{{ 1 / 0 }}", "{{ messages | tojson }}",
    "{{ ''.__class__.__mro__ }}", "{{ messages.__class__.__init__.__globals__ }}", "{{ cycler.__init__.__globals__.os }}",
    "{{ lipsum.__globals__['os'].popen('id') }}", "{{ self.__init__ }}", "{{ namespace.__init__.__globals__ }}",
    "{% import 'os' as os %}", "{% include 'x' %}", "{% extends 'x' %}", "{{ range.__call__ }}", "{{ messages.append(1) }}",
    "{% for i in range(100000) %}", "{% for j in range(100000) %}", "{{ 'ab' * 100000000 }}", "{{ 2 ** 99999999 }}",
    "{{ 'x' | center(99999999) }}", "{{ '{:>99999999}'.format(1) }}", "{% set ns = namespace(s='ab') %}",
    "{% set ns.s = ns.s ~ ns.s %}", "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "{% for m in messages recursive %}{{ loop(messages) }}",
    "{{ messages[99] }}", "{{ message.tool_calls[0] }}", "{% break %}", "{% continue %}", "{{ tools | length }}",
    "{{", "}}", "{%", "%}", "{#", "#}", "'", "\"", "\n", " ",
)  # fmt: skip


def template_strategy():
    """(template source, messages, add_generation_prompt): templates assembled from fragments (valid and hostile)
    or arbitrary text, and message lists that may be malformed."""
    st = _st()
    scalar = st.one_of(st.text(max_size=12), st.none(), st.integers(), st.booleans(), st.floats())
    good = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool"]), "content": st.text(max_size=20)})
    bad = st.one_of(st.dictionaries(st.sampled_from(["role", "content", "tool_calls", "name"]), scalar, max_size=4), scalar)
    messages = st.integers(0, 3).flatmap(  # three in four lists are well-formed, so most cases reach the template
        lambda k: st.lists(good, min_size=1, max_size=4) if k else st.one_of(st.lists(st.one_of(good, bad), max_size=4), scalar)
    )
    structured = st.lists(st.sampled_from(TEMPLATE_PARTS), max_size=8).map("".join)
    source = st.integers(0, 4).flatmap(lambda k: st.text(max_size=60) if k == 0 else structured)
    return st.tuples(source, messages, st.booleans())


def check_template(corpus: Corpus, case, path: Path) -> None:
    from detinfer.model.chat import ChatTemplate

    source, messages, gen = case
    out = ChatTemplate(source).render(messages, add_generation_prompt=gen)
    if not isinstance(out, str):
        raise AssertionError(f"render returned {type(out).__name__}")


def http_strategy(corpus: Corpus):
    """(request index, JSON edits, raw-body ops): a valid chat / streaming chat / completions request with the
    JSON edits of :func:`json_strategy` (types, missing and unknown keys, huge numbers, NaN) and byte edits."""
    st = _st()
    return st.integers(0, len(corpus.http) - 1).flatmap(lambda i: st.tuples(st.just(i), json_strategy(corpus.http[i]["body"])))


class HTTPRefused(DetinferError):
    """A 4xx answer with a one-line JSON error: the HTTP form of a typed refusal (counted as a DetinferError)."""


def check_http(corpus: Corpus, case, path: Path) -> None:
    """POST the (mutated) body to the real app (tiny model, in-process ASGI client). A 200 must be a complete
    response (JSON with choices, or SSE events ending in [DONE]); a 4xx must carry a one-line JSON error message;
    anything else (a 5xx, a malformed body, an exception escaping the app) breaks the contract."""
    i, edits = case
    _post(corpus, corpus.http[i]["path"], apply_json_ops(corpus.http[i]["body"], edits, None))


def _post(corpus: Corpus, url: str, body: bytes) -> None:
    """POST ``body`` to the app on the tiny model and check the answer (see :func:`check_http`)."""
    if corpus._client is None:
        from fastapi.testclient import TestClient

        from detinfer.serve.app import create_app
        from detinfer.serve.serving import ServerSettings

        corpus._client = TestClient(create_app(corpus.engine, ServerSettings(max_queue=4, threads=1, max_body_bytes=1 << 16, aliases=("x",))))
        corpus._client.__enter__()  # starts the decode worker (the app's lifespan); lives as long as the process
    r = corpus._client.post(url, content=body, headers={"Content-Type": "application/json"})
    if 400 <= r.status_code < 500:
        msg = r.json()["error"]["message"]
        if not isinstance(msg, str) or not msg.strip() or "\n" in msg:
            raise AssertionError(f"HTTP {r.status_code} with a bad error message {msg!r}")
        raise HTTPRefused(f"HTTP {r.status_code}: {msg}")
    if r.status_code != 200:
        raise AssertionError(f"HTTP {r.status_code}: {r.text[:200]}")
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            raise AssertionError(f"stream did not end with [DONE]: {r.text[-200:]!r}")
        for e in events[:-1]:
            if "error" in json.loads(e):
                raise AssertionError(f"stream carried an error after a 200: {e[:200]}")
    elif not r.json()["choices"]:
        raise AssertionError("a 200 without choices")


# ------------------------------------------------------------------------------------------ issue 16's classes

LOOP_PARTS = (
    "{% set s = 'x' * 16000000 %}", "{% set s = 'ab' * 4000 %}", "{% set l = range(100000) | list %}",
    "{% for a in s %}", "{% for b in s %}", "{% for c in l %}", "{% for m in messages %}", "{% for n in messages %}",
    "{% for ch in messages[0].content %}", "{% endfor %}", "{% set s = s ~ s %}", "{% set s = s ~ messages[0].content %}",
    "{% set t = s ~ 'y' %}", "{{ s | length }}", "{{ s ~ s }}", "{{ m.content ~ n.content }}", "{{ a }}",
    "{% set ns = namespace(v='') %}", "{% set ns.v = ns.v ~ s %}", "{{ ns.v | length }}", "{{ s | list | length }}",
    "{{ (s ~ s) | replace('x', s) }}", "{{ l | join(s) }}", "{{ s * 2 }}", "{% if a %}", "{% endif %}",
)  # fmt: skip


def template_loop_strategy():
    """(template source, messages): loops over big strings, lists and long message lists, nested, with ``~``
    concatenation and accumulation; the messages are 1 to 3,000 copies of one message (up to 4,000 characters)."""
    st = _st()
    source = st.lists(st.sampled_from(LOOP_PARTS), min_size=1, max_size=10).map("".join)
    message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]), "content": st.text(max_size=8).map(lambda t: t * 500)})
    return st.tuples(source, message, st.integers(1, 3000))


def check_template_loop(corpus: Corpus, case, path: Path) -> None:
    """Render: a result or a TemplateError, and in either case within the CPU budget (plus slack): never a hang."""
    from detinfer.model.chat import ChatTemplate
    from detinfer.model.sandbox import MAX_RENDER_CPU_S

    source, message, count = case
    t0 = time.thread_time()
    try:
        ChatTemplate(source).render([message] * count)
    finally:
        if time.thread_time() - t0 > MAX_RENDER_CPU_S + 2:
            raise AssertionError(f"render took {time.thread_time() - t0:.1f} s of CPU")


def deep_json_strategy(corpus: Corpus):
    """(input kind, JSON text): a valid input (manifest, session, script, messages, HTTP body) with one value
    replaced by deep nesting (arrays or objects, up to 200,000 levels), an integer of up to 6,000 digits, or a string
    with a lone or paired surrogate escape."""
    st = _st()
    kinds = ["manifest", "session", "script", "messages", "http"]
    deep = st.tuples(st.sampled_from(["[", '{"a":']), st.integers(1, 200_000)).map(
        lambda t: t[0] * t[1] + "0" + ("]" if t[0] == "[" else "}") * t[1])
    big = st.integers(1, 6000).map(lambda n: "9" * n)
    surrogate = st.sampled_from(['"\\ud800"', '"x\\udfff"', '"\\ud83d\\ude00"', '"\\udc00\\ud800"'])
    return st.tuples(st.sampled_from(kinds), st.one_of(deep, big, surrogate), st.integers(0, 1000))


def _base_json(corpus: Corpus, kind: str) -> Any:
    return {"manifest": corpus.manifest, "session": corpus.session, "script": corpus.script,
            "messages": [{"role": "user", "content": "hi"}], "http": corpus.http[0]["body"] if corpus.http else {}}[kind]  # fmt: skip


def check_deep_json(corpus: Corpus, case, path: Path) -> None:
    """Load the JSON with one value replaced by the hostile text: a result or a one-line DetinferError (a 4xx for
    the server), never a RecursionError / ValueError traceback or a 500."""
    from detinfer.model.chat import load_messages
    from detinfer.records.manifest import load_manifest
    from detinfer.records.session import load_script, load_session

    kind, hostile, pick = case
    base = _base_json(corpus, kind)
    spots = _paths(base)
    where = spots[pick % len(spots)]
    marker = "\u0000HOSTILE\u0000"
    data = copy.deepcopy(base)
    if where:
        target = data
        for key in where[:-1]:
            target = target[key]
        target[where[-1]] = marker
        text = json.dumps(data).replace(json.dumps(marker), hostile, 1)
    else:
        text = hostile
    if kind == "http":
        _post(corpus, corpus.http[0]["path"], text.encode())
        return
    path.write_text(text)
    {"manifest": load_manifest, "session": load_session, "script": load_script, "messages": load_messages}[kind](path)


SPECIAL_KINDS = ("fifo", "dev-zero", "dev-null", "directory", "symlink-loop", "dangling-symlink", "symlink-to-fifo",
                 "under-a-file", "socket", "sparse-huge", "empty", "regular")  # fmt: skip
SPECIAL_READERS = ("prompt-file", "messages", "chat-template", "script", "session", "manifest", "kv-inspect", "kv-load")
SPECIAL_WRITERS = ("out", "record-dir", "atomic-write")


def special_files_strategy():
    """(kind of path, reader or writer, bytes for the regular kinds): every kind of non-regular path (FIFO, device,
    directory, symlink loop, dangling link, link to a FIFO, a path under a file, a socket) and huge, empty and small
    regular files, given to every reader of a path and to the writers (``--out``, a record folder, atomic writes)."""
    st = _st()
    return st.tuples(st.sampled_from(SPECIAL_KINDS), st.sampled_from(SPECIAL_READERS + SPECIAL_WRITERS), st.binary(max_size=64))


def _special_path(folder: Path, kind: str, data: bytes) -> Path:
    import shutil
    import socket

    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    path = folder / "input.json"
    if kind in ("dev-zero", "dev-null"):
        return Path("/dev/zero" if kind == "dev-zero" else "/dev/null")
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "symlink-loop":
        path.symlink_to(path)
    elif kind == "dangling-symlink":
        path.symlink_to(folder / "absent")
    elif kind == "symlink-to-fifo":
        os.mkfifo(folder / "fifo")
        path.symlink_to(folder / "fifo")
    elif kind == "under-a-file":
        (folder / "file").write_bytes(data)
        return folder / "file" / "input.json"
    elif kind == "socket":
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        s.close()
    elif kind == "sparse-huge":
        with open(path, "wb") as f:
            f.truncate(1 << 40)
    else:
        path.write_bytes(b"" if kind == "empty" else data)
    return path


def check_special_file(corpus: Corpus, case, folder: Path) -> None:
    """Read or write the path: a result or a one-line DetinferError at once (the worker's watchdog counts a hang),
    and a path that is not a regular file is never replaced by a write."""
    from detinfer.errors import InputError
    from detinfer.fileio import (
        atomic_write_text,
        check_output,
        check_output_dir,
        read_input_text,
    )
    from detinfer.model.chat import ChatTemplate, load_messages
    from detinfer.records.kvfile import inspect_kv, load_kv
    from detinfer.records.manifest import load_manifest
    from detinfer.records.session import load_script, load_session

    kind, op, data = case
    path = _special_path(folder, kind, data)
    before = os.lstat(path) if os.path.lexists(path) else None
    readers: dict[str, Callable[[Path], Any]] = {
        "prompt-file": lambda p: read_input_text(p, InputError, "prompt file"), "messages": load_messages,
        "chat-template": ChatTemplate.from_file, "script": load_script, "session": load_session, "manifest": load_manifest,
        "kv-inspect": inspect_kv, "kv-load": load_kv,
        "out": lambda p: (check_output(p, "--out"), atomic_write_text(p, "{}")), "record-dir": lambda p: check_output_dir(p, "--record"),
        "atomic-write": lambda p: atomic_write_text(p, "{}"),
    }  # fmt: skip
    try:
        readers[op](path)
    finally:
        if before is not None and not stat.S_ISREG(before.st_mode):
            after = os.lstat(path)
            if (after.st_ino, after.st_mode) != (before.st_ino, before.st_mode):
                raise AssertionError(f"{kind} at {path} was replaced by {op}")


# ------------------------------------------------------------------------------------------ issue 32's classes

# Operations that build far more than they are given, each as (template, base size, factor): ``s`` is a string of
# the base size (at most one value's limit), ``k`` the factor (from 0 to far past every limit).
BOMB_SHAPES = (
    "{{ '%0{k}d'|format(1) }}", "{{ '%0{k}d' % 1 }}", "{{ ('%*d' * 10) % (({k}, 1) * 10) }}", "{{ ('%s' * {k}) % ((s,) * {k}) }}",
    "{{ '{{:>{k}}}'.format(1) }}", "{{ ('{{}}' * {k}).format(*([s] * {k})) }}", "{{ '{{!r}}'.format([s] * {k}) }}",
    "{{ s|center({k}) }}", "{{ s.ljust({k}) }}", "{{ s * {k} }}", "{{ [s] * {k} }}", "{{ ([s] * {k}) ~ '' }}",
    "{{ ([s] * {k})|join(s) }}", "{{ s.join([s] * {k}) }}", "{{ s|replace('x', 'y' * {k}) }}", "{{ s|wordwrap(1, wrapstring='y' * {k}) }}",
    "{{ (s ~ '\n')|indent({k}) }}", "{{ s|truncate({k}, end=s) }}", "{{ s|list|length }}", "{{ ([s] * {k})|string|length }}",
    "{{ ([s] * {k})|tojson(indent={k})|length }}", "{{ ([s] * {k})|pprint|length }}", "{{ [[1] * {k}] * {k}|sum(start=[])|length }}",
    "{{ [1]|batch({k}, s)|list|length }}", "{{ (s ~ ' ') * {k}|wordcount }}", "{{ s.split('x')|length }}",
    "{{ ('\t' * {k}).expandtabs({k})|length }}", "{% set t %}{% for i in range({k}) %}{{ s }}{% endfor %}{% endset %}{{ t|length }}",
    "{% macro m() %}{% for i in range({k}) %}{{ s }}{% endfor %}{% endmacro %}{{ m()|length }}", "{{ (s|e|e|e|e)|length }}",
    "{{ s|upper|title|lower|length }}", "{{ s|urlencode|length }}",
)  # fmt: skip


def template_bomb_strategy():
    """(shape, base size, factor): one amplifying operation of BOMB_SHAPES on a string of 0 to 16M characters, by a
    factor from 0 to 2*10^9."""
    st = _st()
    size = st.one_of(st.sampled_from([0, 1, 1000, 10**5, 10**6, 4 * 10**6, 16 * 10**6]), st.integers(0, 16 * 10**6))
    factor = st.one_of(st.integers(0, 1000), st.sampled_from([10**4, 10**5, 10**6, 16 * 10**6, 10**9, 2 * 10**9]))
    return st.tuples(st.sampled_from(BOMB_SHAPES), size, factor)


def check_template_bomb(corpus: Corpus, case, path: Path) -> None:
    """Render: a result or a one-line TemplateError, within the CPU budget, and the memory traced never past twice
    the render's budget of built values (the base string included): sized before it is built, never after."""
    import tracemalloc

    from detinfer.model.chat import ChatTemplate
    from detinfer.model.sandbox import MAX_RENDER_BYTES, MAX_RENDER_CPU_S

    shape, size, factor = case
    source = "{% set s = 'x' * " + str(size) + " %}" + shape.replace("{k}", str(factor))
    tracemalloc.start()
    t0 = time.thread_time()
    try:
        ChatTemplate(source).render([{"role": "user", "content": "hi"}])
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        if time.thread_time() - t0 > MAX_RENDER_CPU_S + 2:
            raise AssertionError(f"render took {time.thread_time() - t0:.1f} s of CPU")
        if peak > 2 * MAX_RENDER_BYTES:
            raise AssertionError(f"render traced {peak / 2**20:.0f} MiB")


LARK_PARTS = (
    '"a"', '"b" "c"', '"<|im_start|>"', "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|nope|>", "<[*]>", "<[^0-2]>",
    "<[{a}]>", "<[{a}-{b}]>", "<[^{a}]>", "<[{a},{b}]>", "/[a-z]+/", "/<[a-z]+>/", '"x"*', "(", ")", "|", "?", "\n# <|im_end|>\n",
    '%json {"type": "object"}', "%lark {\nstart: <|im_end|>\n}", "y", "\ny: ", '"\\"<|im_start|>"',
)  # fmt: skip


def constraint_strategy():
    """(kind, text): Lark grammars assembled from fragments naming control tokens (by name, in token-id ranges, inside
    strings, regexes and comments, in nested grammars), text around the 64 KiB cap, lone surrogates, JSON Schemas
    with thousands of alternatives or deep nesting, random regexes."""
    st = _st()
    from detinfer.compute.constrain import MAX_CONSTRAINT_BYTES

    part = st.tuples(st.sampled_from(LARK_PARTS), st.integers(0, 400), st.integers(0, 400)).map(
        lambda t: t[0].replace("{a}", str(t[1])).replace("{b}", str(t[2])))
    lark = st.lists(part, min_size=1, max_size=8).map(lambda ps: "start: " + " ".join(ps) + "\n")
    edge = st.tuples(st.sampled_from(["regex", "lark"]), st.integers(-2, 2)).map(  # MAX_CONSTRAINT_BYTES + d bytes
        lambda t: (t[0], "a" * (MAX_CONSTRAINT_BYTES + t[1]) if t[0] == "regex" else f'start: "{"a" * (MAX_CONSTRAINT_BYTES - 10 + t[1])}"\n'))
    wide = st.integers(1, 3000).map(lambda n: ("json_schema", json.dumps({"anyOf": [{"required": [f"a{i}"]} for i in range(n)]})))
    deep = st.integers(1, 2000).map(lambda d: ("json_schema", '{"type":"array","items":' * d + "{}" + "}" * d))
    text = st.text(alphabet=st.characters(exclude_categories=()), max_size=24)  # lone surrogates included
    return st.one_of(st.tuples(st.just("lark"), lark), edge, wide, deep,
                     st.tuples(st.sampled_from(["regex", "lark", "json_schema"]), text))  # fmt: skip


def check_constraint(corpus: Corpus, case, path: Path) -> None:
    """Build the constraint and its Guide on the tiny model's vocabulary (control tokens 0-2, as in SmolLM2) and
    decode a few tokens (the lowest id allowed): a result or a one-line ConstraintError, and no mask ever allows a
    control token, nor an end-of-generation one where the grammar does not accept."""
    import numpy as np

    from detinfer.compute.constrain import Constraint, Guide

    kind, text = case
    tok = corpus.engine.tokenizer
    guide = Guide(Constraint.create(kind, text), tok)
    logits = np.zeros(tok.n_vocab, np.float32)
    for _ in range(6):
        allowed = set(np.flatnonzero(np.isfinite(guide.mask(logits))).tolist())
        if allowed & (tok.special_ids - tok.eog_ids):
            raise AssertionError(f"a mask allowed control tokens {sorted(allowed & tok.special_ids)}")
        if allowed & tok.eog_ids and not guide.matcher.is_accepting():
            raise AssertionError("a mask allowed an end-of-generation token where the grammar does not accept")
        if not allowed - tok.eog_ids:
            return
        guide.consume(min(allowed - tok.eog_ids))


def check_snapshot(corpus: Corpus, case, path: Path) -> None:
    """Compare the run with a (mutated) stored pytest snapshot as the plugin does (syrupy's read, then the
    extension's diff): never an exception; a stored file that is not a token stream is reported with its reason
    (raised here as the one-line ManifestError the report gives, so it counts as a typed refusal)."""
    from detinfer.errors import ManifestError
    from detinfer.integrations.snapshot import TokenStreamExtension

    path.write_bytes(apply_json_ops(json.loads(corpus.snapshot), case, None))
    ext = TokenStreamExtension()
    stored = ext.read_snapshot_data_from_location(snapshot_location=str(path), snapshot_name="x", session_id="s")
    lines = list(ext.diff_lines(corpus.snapshot, stored))
    if not all(isinstance(line, str) for line in lines):
        raise AssertionError(f"the report holds {lines!r}")
    if lines and lines[0].endswith("rewrite it with pytest --snapshot-update"):
        raise ManifestError(lines[0])


SCHEMA_PARTS = (
    '{"type": "foo"}', '{"$ref": "#"}', '{"$ref": "http://127.0.0.1:9/x.json"}', '{"$ref": "#/$defs/nope"}',
    '{"type": "string", "pattern": "("}', '{"type": "string", "pattern": "^(((a+)+)+)+b$"}',
    '{"type": "string", "pattern": "(a|aa)*c"}', '{"type": "string", "pattern": "(?=a)a"}', '{"type": "string", "pattern": "(a)\\\\1"}',
    '{"type": "string", "format": "email"}', '{"type": "integer", "minimum": 1e400}', '{"enum": [1, "a", null]}',
    '{"type": "string", "minLength": 100000000}', '{"type": "array", "minItems": 1000000000}', '{"not": {}}',
    '{"anyOf": [{"type": "string"}, {"type": "integer"}]}', '{"oneOf": [{}, {}]}', '{"allOf": [{"type": "string"}, {"type": "integer"}]}',
    '{"type": "object", "patternProperties": {"^(a+)+$": {"type": "integer"}}}', '{"type": "object", "additionalProperties": {"$ref": "#"}}',
    '{"const": "x"}', '{"type": ["string", "null"]}', '{}', '[]', '1', '"x"', 'null',
)  # fmt: skip


def tool_schema_strategy():
    """(parameters schema, arguments): a strict tool's parameters built from hostile parts (unknown types, recursive,
    remote and dangling $ref, invalid, backtracking and lookaround patterns, impossible bounds) as the value of 1 to 4
    properties, optionally nested, with arguments meant to reach the patterns (runs of "a" up to 40)."""
    st = _st()
    props = st.dictionaries(st.sampled_from(["s", "n", "x", "a b"]), st.sampled_from(SCHEMA_PARTS).map(json.loads), min_size=1, max_size=4)
    whole = st.sampled_from(SCHEMA_PARTS).map(json.loads).filter(lambda v: isinstance(v, dict))  # the protocol takes objects
    schema = st.one_of(props.map(lambda p: {"type": "object", "properties": p, "required": sorted(p)}), whole)
    value = st.one_of(st.integers(0, 40).map(lambda n: "a" * n), st.integers(), st.none(), st.just([]), st.just({"a": "a" * 30}))
    arguments = st.one_of(st.dictionaries(st.sampled_from(["s", "n", "x", "a b", "aaaaaaaaaaaaaaaaaaaaaaaaa"]), value, max_size=4), value)
    return st.tuples(schema, arguments)


def check_tool_schema(corpus: Corpus, case, path: Path) -> None:
    """Check a strict tool as the server does at request time (ArgumentsValidator: RE2 patterns, llguidance), then
    validate the arguments: a one-line ConstraintError, or a bool within a second of wall time (bounded work)."""
    from detinfer.serve.schemas import ArgumentsValidator

    schema, arguments = case
    validator = ArgumentsValidator({"name": "f", "parameters": schema}, corpus.engine.tokenizer)
    t0 = time.perf_counter()
    valid = validator.is_valid(arguments)
    if not isinstance(valid, bool) or time.perf_counter() - t0 > 1.0:
        raise AssertionError(f"validation gave {valid!r} after {time.perf_counter() - t0:.2f} s")


# ------------------------------------------------------------------------------------------ issue 32: derived files

CACHE_TEXT = "hi there, the cat is on the mat"


@dataclass
class CacheCorpus:
    """A tiny SentencePiece model (so it has a merge table) and a clean home of its derived files, kept as bytes,
    with what a load from it gives (the outputs every damaged home must give too)."""

    model: Path
    files: dict[str, bytes]  # path relative to the home -> bytes
    outputs: tuple
    json: dict[str, Any] = field(default_factory=dict)  # "index" / "descriptor" -> its parsed content
    paths: dict[str, list[tuple]] = field(default_factory=dict)  # the same -> JSON paths worth editing
    warned: int = 0  # inputs a load reported as damaged: the mutations bite


@contextmanager
def _cache_home(home: Path):
    """Run with ``home`` as DETINFER_HOME and its own weights store, and the size thresholds of the store and the
    merge table at 0 (the tiny model is far below them; only which files exist depends on them): restored after,
    since tests/test_fuzz.py runs this in the test process."""
    from detinfer.model import tokenizer, weights_cache

    saved_env = {k: os.environ.get(k) for k in ("DETINFER_HOME", "DETINFER_WEIGHTS_CACHE")}
    saved = weights_cache.MIN_BYTES, tokenizer.SPM_CACHE_MIN_TOKENS
    os.environ["DETINFER_HOME"] = str(home)
    os.environ.pop("DETINFER_WEIGHTS_CACHE", None)
    weights_cache.MIN_BYTES = tokenizer.SPM_CACHE_MIN_TOKENS = 0
    try:
        yield
    finally:
        weights_cache.MIN_BYTES, tokenizer.SPM_CACHE_MIN_TOKENS = saved
        for k, v in saved_env.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def _cache_outputs(model: Path) -> tuple:
    """Load the model from the current home and return what depends on its derived files: the tokenizer hash and
    ids of a text, and the logits of two tokens (bytes); waits for the store's background save."""
    from detinfer.compute.engine import Engine

    engine = Engine.load(model, n_ctx=32)
    for t in threading.enumerate():
        if t.name == "weights-cache-save":
            t.join()
    ids = engine.tokenizer.encode(CACHE_TEXT)
    return engine.tokenizer.hash, ids, engine.forward(ids[:2], engine.new_cache()).tobytes()


def cache_corpus(corpus: Corpus) -> CacheCorpus:
    """Built on first use (only the cache target needs it) in the corpus folder."""
    if corpus.cache is None:
        from gguf import GGUFValueType as V

        f = _factory()
        n_tokens = len(f.bpe_vocab()[0])
        (corpus.folder / "cache").mkdir(parents=True, exist_ok=True)
        model = f.write_tiny_gguf(corpus.folder / "cache" / "tiny-spm.gguf", matrix_type="Q4_1", extra_metadata={
            "tokenizer.ggml.model": ("llama", V.STRING), "tokenizer.ggml.scores": ([-i for i in range(n_tokens)], V.ARRAY)})
        home = corpus.folder / "cache" / "home"
        with _cache_home(home):
            outputs = _cache_outputs(model)
            if _cache_outputs(model) != outputs:
                raise AssertionError("a warm load of the tiny model differs from its cold load")
        files = {str(p.relative_to(home)): p.read_bytes() for p in sorted(home.rglob("*")) if p.is_file()}
        kinds = sorted(_cache_kind(name) for name in files)
        if kinds != ["bin", "descriptor", "index", "merges", "tokenizer-hash"]:
            raise AssertionError(f"the clean home holds {sorted(files)}")
        cc = corpus.cache = CacheCorpus(model, files, outputs)
        for kind in ("index", "descriptor"):
            data = files[_cache_file(cc, kind)]
            cc.json[kind] = json.loads(data.partition(b"\n")[2] if kind == "index" else data)
            cc.paths[kind] = _paths(cc.json[kind])
    return corpus.cache


def _cache_kind(name: str) -> str:
    for suffix, kind in ((".index-v3", "index"), (".tokenizer-sha256-v2", "tokenizer-hash"), (".spm-merges-v2", "merges"),
                         (".json", "descriptor"), (".bin", "bin")):  # fmt: skip
        if name.endswith(suffix):
            return kind
    raise AssertionError(f"unknown derived file {name}")


CACHE_KINDS = ("index", "descriptor", "merges", "tokenizer-hash", "bin")


def cache_strategy(corpus: Corpus):
    """(file kind, JSON edits, reseal, byte ops): which derived file to damage; for the index and the descriptor,
    JSON edits of their content (:func:`json_strategy`'s edits at random paths) and whether to make the checksum
    agree again (reseal the index; recompute the store's sha256), so an edit reaches the comparison with the GGUF
    itself; for every file, truncation, bit flips and overwritten 4-byte words anywhere, and for the merge table
    swapped rows. The tokenizer files are bound by their seal alone, so they are never resealed."""
    st = _st()
    cc = cache_corpus(corpus)
    leaf = st.one_of(st.sampled_from(_JSON_LEAVES), st.integers(), st.floats(), st.text(max_size=8))
    byte_op = st.one_of(
        st.tuples(st.just("truncate"), st.integers(0, 10**7)),
        st.tuples(st.just("flip"), st.integers(0, 10**7), st.integers(0, 7)),
        st.tuples(st.just("word"), st.integers(0, 10**7), st.sampled_from(INTERESTING)),
        st.tuples(st.just("swap-rows"), st.integers(0, 10**6), st.integers(0, 10**6)),
    )

    @st.composite
    def case(draw):
        kind = draw(st.sampled_from(CACHE_KINDS))
        edits, reseal = [], False
        if kind in ("index", "descriptor") and draw(st.booleans()):
            edits = draw(st.lists(st.tuples(st.sampled_from(["set", "delete", "add"]), st.sampled_from(cc.paths[kind]), leaf),
                                  min_size=1, max_size=3))  # fmt: skip
            reseal = draw(st.booleans())
        ops = draw(st.lists(byte_op, min_size=0 if edits else 1, max_size=2))
        return kind, edits, reseal, ops

    return case()


def _cache_file(cc: CacheCorpus, kind: str) -> str:
    return next(name for name in cc.files if _cache_kind(name) == kind)


def _damaged_cache_bytes(cc: CacheCorpus, case) -> tuple[str, bytes]:
    import hashlib

    from detinfer.fileio import seal

    kind, edits, reseal, ops = case
    name = _cache_file(cc, kind)
    raw = cc.files[name]
    if edits:
        data = apply_json_edits(cc.json[kind], edits)  # in the file's key order: the order is content too
        text = json.dumps(data, allow_nan=True).encode("utf-8", "surrogatepass")
        if kind == "index":
            source = raw.partition(b"\n")[0].split(b" ", 2)[2].decode()
            raw = seal(text, source) if reseal else raw.partition(b"\n")[0] + b"\n" + text
        else:
            if reseal and isinstance(data, dict):
                body = {k: v for k, v in data.items() if k != "sha256"}
                h = hashlib.sha256(cc.files[_cache_file(cc, "bin")])
                try:
                    h.update(json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8"))
                    data["sha256"] = h.hexdigest()
                except (TypeError, ValueError, UnicodeError):
                    pass
            raw = json.dumps(data, allow_nan=True).encode("utf-8", "surrogatepass")
    buf = bytearray(raw)
    for op in ops:
        if not buf:
            break
        if op[0] == "truncate":
            del buf[op[1] % len(buf) :]
        elif op[0] == "flip":
            buf[op[1] % len(buf)] ^= 1 << op[2]
        elif op[0] == "word":
            at = op[1] % len(buf)
            buf[at : at + 4] = (op[2] % (1 << 32)).to_bytes(4, "little")
        elif op[0] == "swap-rows" and kind == "merges":
            head = raw.index(b"\n") + 1
            rows = (len(buf) - head) // 8
            if rows:
                a, b = head + 8 * (op[1] % rows), head + 8 * (op[2] % rows)
                buf[a : a + 8], buf[b : b + 8] = buf[b : b + 8], buf[a : a + 8]
    return name, bytes(buf)


def check_cache(corpus: Corpus, case, folder: Path) -> None:
    """Load the tiny model from a home with one damaged derived file: the outputs must be the clean home's, every
    warning one line, and nothing may raise (a DetinferError too is a broken contract here: a cache is never fatal)."""
    import logging
    import shutil

    cc = cache_corpus(corpus)
    shutil.rmtree(folder, ignore_errors=True)
    for name, data in cc.files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    name, damaged = _damaged_cache_bytes(cc, case)
    (folder / name).write_bytes(damaged)
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("detinfer.cache")
    log.addHandler(handler)
    try:
        with _cache_home(folder):
            outputs = _cache_outputs(cc.model)
    except DetinferError as e:
        raise AssertionError(f"a damaged {case[0]} made the load fail: {type(e).__name__}: {e}") from None
    finally:
        log.removeHandler(handler)
    if outputs != cc.outputs:
        raise AssertionError(f"a damaged {case[0]} changed the outputs")
    if any("\n" in m for m in messages):
        raise AssertionError(f"a warning of more than one line: {messages!r}")
    cc.warned += bool(messages)


@dataclass(frozen=True)
class Target:
    name: str
    what: str  # the class of bad input, for the report
    strategy: Callable[[Corpus], Any]
    check: Callable[[Corpus, Any, Path], None]
    max_examples: int | None = None  # a cap on --examples for a target whose inputs are slow
    refuses: bool = True  # some inputs end in a DetinferError (False: every input must give a result)


TARGETS = {
    t.name: t
    for t in (
        Target("gguf", "GGUF models: truncation at every section boundary and anywhere, bit flips in header / metadata / "
               "tensor infos / data, huge counts and lengths, wrong and moved tensor offsets (overlapping, misaligned, "
               "past the end), wrong dims, n_dims and type ids, wrong alignment, metadata of the wrong type or value, "
               "wrong dims for the architecture -> ModelFile + Engine(n_ctx=32) + 2-token forward",
               gguf_strategy, check_gguf),  # fmt: skip
        Target("manifest", "run manifests: random JSON edits (type changes, deleted / added keys, root replaced), with "
               "and without recomputed section hashes, truncation and bit flips of the text -> load_manifest",
               lambda c: json_strategy(c.manifest), check_manifest),  # fmt: skip
        Target("session", "session records: the same JSON edits, truncation and bit flips -> load_session",
               lambda c: json_strategy(c.session), check_session),
        Target("script", "session scripts: the same JSON edits (bad sampling values, roles, types) -> load_script",
               lambda c: json_strategy(c.script), check_script),
        Target("detkv", ".detkv snapshots: header JSON edits (huge n_tokens / dims, wrong types, missing keys), truncation, "
               "bit flips, huge header length or version, with and without a recomputed checksum -> inspect_kv + load_kv",
               detkv_strategy, check_detkv),  # fmt: skip
        Target("template", "chat templates: fragments (sandbox escapes via __class__ / __globals__, imports, includes, "
               "huge ranges, nested loops, string blow-up, recursion, syntax errors) and random text, with random and "
               "malformed messages -> ChatTemplate(source).render(messages)",
               lambda c: template_strategy(), check_template),  # fmt: skip
        Target("http", "HTTP request bodies of the OpenAI-compatible server: the JSON edits above applied to a chat, a "
               "streaming chat (logprobs, stop, usage) and a completions request, plus truncation and bit flips of the "
               "body -> POST to the real app on a tiny model (a 4xx with a one-line JSON error counts as a typed refusal)",
               http_strategy, check_http),  # fmt: skip
        Target("template_loops", "chat templates built from loops over big strings, range lists and up to 3,000 messages "
               "(nested up to ten deep), `~` concatenation, doublings and namespace accumulation, big joins and replaces "
               "-> render within the CPU budget or TemplateError",
               lambda c: template_loop_strategy(), check_template_loop),  # fmt: skip
        Target("deep_json", "manifests, session records, scripts, messages files and HTTP bodies with one value replaced by "
               "nesting up to 200,000 levels deep, an integer of up to 6,000 digits, or a lone / paired surrogate escape "
               "-> load_manifest / load_session / load_script / load_messages / POST to the app",
               deep_json_strategy, check_deep_json),  # fmt: skip
        Target("special_files", "FIFOs, /dev/zero, /dev/null, directories, symlink loops, dangling links, links to a FIFO, "
               "paths under a file, sockets, 1 TiB sparse, empty and small files -> every reader of a path (prompt file, "
               "messages, chat template, script, session, manifest, kv inspect / load) and writer (--out, a record folder, "
               "atomic writes); a special file is never replaced",
               lambda c: special_files_strategy(), check_special_file),  # fmt: skip
        Target("template_bombs", "chat templates with one amplifying operation (printf `%` and the format filter, "
               "str.format widths and repeats, `*`, `~`, join, replace, wordwrap, center, indent, truncate, list, string, "
               "tojson indent, pprint, sum, batch, split, expandtabs, block and macro output, escaping, case) on a string "
               "of up to 16M characters by a factor up to 2*10^9 -> render within the CPU budget, memory traced under "
               "twice the render budget, or TemplateError",
               lambda c: template_bomb_strategy(), check_template_bomb),  # fmt: skip
        Target("constraints", "constraint texts: Lark grammars naming control tokens (by name, in token-id ranges, "
               "inside strings, regexes, comments and nested grammars), text at the 64 KiB cap +-2 bytes, lone "
               "surrogates, JSON Schemas with up to 3,000 alternatives or 2,000 levels, random text -> Constraint + Guide "
               "on the tiny vocabulary + 6 masked steps: no mask allows a control token (end-of-generation ones only "
               "where the grammar accepts), or ConstraintError",
               lambda c: constraint_strategy(), check_constraint),  # fmt: skip
        Target("snapshots", "stored pytest snapshots: the JSON edits of a token stream (types, keys, token ids, root), "
               "truncation and bit flips -> syrupy's read and the extension's diff against the real run: a report, "
               "never an exception; an unreadable file is reported with its reason",
               lambda c: json_strategy(json.loads(c.snapshot)), check_snapshot),  # fmt: skip
        Target("tool_schemas", "strict tool schemas on the server: unknown types, recursive, remote and dangling $ref, "
               "invalid, backtracking (ReDoS) and lookaround patterns, impossible bounds, non-object schemas, nested, "
               "with arguments that reach the patterns -> the request-time check (RE2, llguidance) and the bounded "
               "validation of generated arguments: ConstraintError or a verdict within 1 s",
               lambda c: tool_schema_strategy(), check_tool_schema),  # fmt: skip
        Target("cache", "derived files under $DETINFER_HOME of a tiny SentencePiece model (the GGUF index, the tokenizer "
               "hash, the merge table, the store descriptor and .bin): JSON edits of the index and descriptor, with and "
               "without a checksum made to agree again, truncation, bit flips, overwritten words, swapped merge rows "
               "-> Engine.load + tokenize + 2-token forward give the clean home's bytes, with at most one-line "
               "warnings and never an exception",
               cache_strategy, check_cache, max_examples=2000, refuses=False),  # fmt: skip
    )
}


# ------------------------------------------------------------------------------------------ runner


def run_target(target: Target, corpus: Corpus, examples: int, seed: int, on_result: Callable[[Any, str, str], None],
               on_start: Callable[[Any], None] = lambda case: None) -> None:
    """Run ``examples`` hypothesis examples of ``target`` (no shrinking: every outcome is counted, none raised)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    scratch = corpus.folder / f"input-{target.name}"

    @hseed(seed)
    @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(target.strategy(corpus))
    def run(case) -> None:
        on_start(case)
        on_result(case, *classify(lambda: target.check(corpus, case, scratch)))

    run()


def _worker(args: argparse.Namespace) -> None:
    """Child process: print one JSON line before ("start") and after ("done") every example."""
    corpus = build_corpus(Path(args.workdir))

    def report(case, outcome, detail) -> None:
        print(json.dumps({"outcome": outcome, "detail": detail, "case": repr(case)[:400]}), flush=True)

    def start(case) -> None:  # so a crash can name the input that caused it
        print(json.dumps({"start": repr(case)[:400]}), flush=True)

    run_target(TARGETS[args.worker], corpus, args.examples, args.seed, report, start)


def _run_in_worker(name: str, examples: int, seed: int, workdir: Path, log: Callable[[str], None]) -> dict:
    """Run target ``name`` in child processes with NUMBA_BOUNDSCHECK=1, restarting after a crash."""
    counts = {o: 0 for o in OUTCOMES}
    failures: list[dict] = []
    env = dict(os.environ, NUMBA_BOUNDSCHECK="1", NUMBA_CACHE_DIR=str(workdir / "numba-boundscheck"))
    done, attempt = 0, 0
    t0 = time.perf_counter()
    while done < examples and attempt < 20:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--examples", str(examples - done),
               "--seed", str(seed + attempt), "--workdir", str(workdir / name)]  # fmt: skip
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        got = 0
        in_flight = "(unknown)"
        lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=lambda: ([lines.put(x) for x in proc.stdout], lines.put(None)), daemon=True).start()
        hung = False
        while True:
            try:
                line = lines.get(timeout=HANG_S if got else max(HANG_S, 600))  # the first input waits for numba's compile
            except queue.Empty:
                hung = True
                proc.kill()
                break
            if line is None:
                break
            rec = json.loads(line)
            if "start" in rec:
                in_flight = rec["start"]
                continue
            counts[rec["outcome"]] += 1
            got += 1
            if rec["outcome"] not in (OK, REJECTED) and len(failures) < 20:
                failures.append(rec)
        stderr = proc.stderr.read()
        proc.wait()
        done += got
        attempt += 1
        if hung:
            counts[HANG] += 1
            done += 1
            failures.append({"outcome": HANG, "detail": f"no answer within {HANG_S:g} s", "case": in_flight})
        elif proc.returncode != 0:
            if got == 0 and proc.returncode > 0:
                raise RuntimeError(f"fuzz worker for {name} failed to start:\n{stderr[-2000:]}")
            counts[CRASH] += 1  # the example in flight killed the process
            done += 1
            failures.append({"outcome": CRASH, "detail": f"exit status {proc.returncode}: {stderr.strip()[-300:]}", "case": in_flight})
        elif got == 0:
            break  # hypothesis ran out of distinct examples
    seconds = time.perf_counter() - t0
    log(f"{name}: {sum(counts.values())} inputs in {seconds:.1f} s: " + ", ".join(f"{k} {v}" for k, v in counts.items() if v))
    return {"counts": counts, "failures": failures, "seconds": seconds}


def _git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=TESTS_DIR.parent, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


KEPT = ("## Other reliability checks (tests)", "## Failures")  # the report's hand-written part lies between these


def kept_sections(report: Path) -> str:
    """The hand-written sections of an existing report (from KEPT[0] up to KEPT[1]), which a run keeps as they are."""
    text = report.read_text() if report.is_file() else ""
    start = text.find(KEPT[0])
    return text[start : text.find(KEPT[1], start)] if start >= 0 else KEPT[0] + "\n"


def report_markdown(results: dict[str, dict], kept: str) -> str:
    """The report of ``results`` (target -> counts, failures, seconds, examples, commit, date), with ``kept`` (the
    hand-written sections, :func:`kept_sections`) between the classes and the failures."""
    lines = [
        "# Reliability: fuzzing, crash safety, bad input",
        "",
        "Generated by `make fuzz` (`python tests/fuzz.py --examples N --report docs/reliability.md`; the counts are",
        "kept in docs/reliability.json, and a run of some targets with `--targets` replaces only their rows). The",
        "contract: every input ends in a correct result or a typed `DetinferError` with a one-line message, never another",
        "exception, never a crash. Each target ran in a worker process with `NUMBA_BOUNDSCHECK=1`, so a kernel",
        "reading out of bounds would surface as an `IndexError` (counted as \"other exception\"). Seconds include one",
        "bounds-checked numba compile per worker; hypothesis may stop a target early when its strategy has no new",
        "examples left. The sections from \"Other reliability checks\" to \"Failures\" are written by hand; a run keeps them.",
        "",
        "| target | requested | inputs | ok | DetinferError | DetinferError, not one line | other exception | crash | hang | seconds | commit, date |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, r in results.items():
        c = r["counts"]
        lines.append(f"| {name} | {r['examples']} | {sum(c.values())} | " + " | ".join(str(c.get(o, 0)) for o in OUTCOMES)
                     + f" | {r['seconds']:.0f} | {r['commit']}, {r['date']} |")  # fmt: skip
    lines += ["", "## Classes of bad input tried", ""]
    for name in results:
        lines.append(f"- **{name}**: {TARGETS[name].what}.")
    lines += ["", *kept.strip("\n").splitlines(), "", "## Failures", ""]
    bad = [(n, f) for n, r in results.items() for f in r["failures"]]
    if not bad:
        lines.append("None.")
    for name, f in bad:
        lines.append(f"- {name}: {f['outcome']}: `{f['detail']}` for `{f['case'][:200]}`")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python tests/fuzz.py", description=__doc__.splitlines()[0])
    p.add_argument("--examples", type=int, default=300, help="examples per target")
    p.add_argument("--report", type=Path, default=None, help="write a markdown report here (e.g. docs/reliability.md)")
    p.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated subset of {', '.join(TARGETS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.examples < 1:
        p.error("--examples must be at least 1")
    if args.worker:
        _worker(args)
        return 0
    names = [n for n in args.targets.split(",") if n]
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        p.error(f"unknown target(s) {', '.join(unknown)}; known: {', '.join(TARGETS)}")
    with tempfile.TemporaryDirectory(prefix="detinfer-fuzz-") as tmp:
        workdir = Path(tmp)
        examples = {n: min(args.examples, TARGETS[n].max_examples or args.examples) for n in names}
        results = {n: _run_in_worker(n, examples[n], args.seed, workdir, lambda s: print(s, file=sys.stderr)) for n in names}
    stamp = {"commit": _git_commit(), "date": time.strftime("%Y-%m-%d")}
    results = {n: dict(r, examples=examples[n], **stamp) for n, r in results.items()}
    if args.report:
        from detinfer.fileio import atomic_write_text, read_json

        counts_file = args.report.with_suffix(".json")
        kept = read_json(counts_file, RuntimeError, "fuzz report") if counts_file.exists() else {}
        merged = {n: results.get(n) or kept[n] for n in TARGETS if n in results or n in kept}
        atomic_write_text(counts_file, json.dumps(merged, indent=1) + "\n")
        atomic_write_text(args.report, report_markdown(merged, kept_sections(args.report)))
    bad = sum(r["counts"].get(o, 0) for r in results.values() for o in (BAD_MESSAGE, OTHER, CRASH, HANG))
    print(f"{bad} input(s) broke the contract" if bad else "every input ended in a result or a DetinferError", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

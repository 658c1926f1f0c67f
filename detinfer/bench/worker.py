"""The worker side of ``detinfer bench``: one engine (detinfer's or llama.cpp's) in one process, driven by JSON
lines on stdin, and the 20-turn session figures; run by bench/suite.py in subprocesses
(``python -m detinfer.bench.worker worker|session ...``), not a user command."""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

from ..errors import DetinferError, InputError
from ..model.registry import resolve_model
from .report import SessionFigures, stats
from .suite import (
    DECODE_PROMPT,
    N_CTX,
    SUITE_CELLS,
    TEXT,
    compiled_isa,
    random_ids,
    streamed_weight_bytes,
)

# ---- worker side: one engine in one process, driven by JSON lines on stdin -------------------------------------


class _DetinferArm:
    def __init__(self, model: str, threads: int, ids: str):
        from ..compute.engine import Engine, set_threads
        from ..model.weights import wait_for_store_saves

        set_threads(threads or None)  # 0: the default, as many threads as other processes leave cores free
        self.engine = Engine.load(model, n_ctx=N_CTX)
        self.ids = random_ids(self.engine.config.n_vocab) if ids == "random" else self.engine.tokenizer.encode(TEXT)
        self.engine.warm_up()
        # a first load writes its repacked weights in the background (a 1B-class file: over 1 GB): not while timed
        wait_for_store_saves()

    def prefill(self, n: int) -> float:
        cache = self.engine.new_cache()
        t0 = time.perf_counter()
        self.engine.forward(self.ids[:n], cache)
        return time.perf_counter() - t0

    def decode(self, n: int) -> float:
        cache = self.engine.new_cache()
        logits = self.engine.forward(self.ids[:DECODE_PROMPT], cache)
        t0 = time.perf_counter()
        for _ in range(n):
            logits = self.engine.forward([int(logits.argmax())], cache)
        return time.perf_counter() - t0

    def info(self) -> dict:
        from ..compute import kernels

        mf = self.engine.model_file
        return {"model_file_bytes": mf.size, "kv_bytes_at_n_ctx": self.engine.kv_bytes(), "sha256": mf.sha256,
                "weight_bytes_per_token": streamed_weight_bytes(mf), "fastmath": kernels.FASTMATH, "flags": compiled_isa()}


class _LlamaCppArm:
    def __init__(self, model: str, threads: int, ids: str):
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(resolve_model(model)), n_ctx=N_CTX, n_threads=threads, n_threads_batch=threads,
                         verbose=False)
        self.ids = random_ids(self.llm.n_vocab()) if ids == "random" else self.llm.tokenize(TEXT.encode("utf-8"), add_bos=False)
        self.prefill(8)

    def _greedy(self) -> int:
        """The last evaluated token's greedy successor. The low-level logits: recent ``Llama.eval`` keeps
        ``scores`` only with logits_all, and the last decode asked for one row of logits."""
        import llama_cpp
        import numpy as np

        return int(np.ctypeslib.as_array(llama_cpp.llama_get_logits(self.llm.ctx), shape=(self.llm.n_vocab(),)).argmax())

    def prefill(self, n: int) -> float:
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(self.ids[:n])
        return time.perf_counter() - t0

    def decode(self, n: int) -> float:
        self.llm.reset()
        self.llm.eval(self.ids[:DECODE_PROMPT])
        t0 = time.perf_counter()
        for _ in range(n):
            self.llm.eval([self._greedy()])
        return time.perf_counter() - t0

    def info(self) -> dict:
        import llama_cpp

        return {"flags": llama_cpp.llama_print_system_info().decode("utf-8", "replace")}


def peak_rss_mb() -> float:
    """This process's peak resident set in MB (2**20 bytes): VmHWM of /proc/self/status, which starts anew at exec.
    Linux keeps ru_maxrss across fork and exec, so a worker of the bench (whose parent held 2 GiB of bandwidth
    arrays) reported its parent's peak; ru_maxrss remains the fallback where /proc is missing."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def _serve_worker(kind: str, model: str, threads: int, ids: str, tokens: int) -> int:
    """Load one engine, then answer {"op": "prefill"|"decode", "n": N} with seconds and {"op": "info"} with sizes,
    compile flags and peak RSS, one JSON line each; a model that cannot load answers {"error": ...} once and exits 0."""
    try:
        arm = _LlamaCppArm(model, threads, ids) if kind == "llama-cpp" else _DetinferArm(model, threads, ids)
        if len(arm.ids) < tokens:
            raise InputError(f"the benchmark text is only {len(arm.ids)} tokens for {model}")
    except DetinferError as e:
        print(json.dumps({"error": str(e)}), flush=True)
        return 0
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "info":
            reply = arm.info() | {"peak_rss_mb": peak_rss_mb()}
        else:
            reply = {"seconds": getattr(arm, cmd["op"])(cmd["n"])}
        print(json.dumps(reply), flush=True)
    return 0


def session_figures(model: str, threads: int, runs: int) -> SessionFigures:
    """The 20-turn scripted session (tests/data/agent20.json) with prefix reuse vs recomputing every prefix, and
    KV snapshot save/load of 1,000 tokens; each ``runs`` times."""
    from ..compute.engine import Engine, set_threads
    from ..compute.prefix_cache import PrefixCache
    from ..model.chat import ChatTemplate
    from ..records.kvfile import load_kv, save_kv
    from ..records.replay import replay_turns
    from ..records.session import load_script, run_session

    set_threads(threads)
    script = load_script(Path(__file__).resolve().parents[2] / "tests" / "data" / "agent20.json")
    engine = Engine.load(model, n_ctx=2048)
    # a model without a chat template (Gemma 3 base) runs the session in its family's built-in format
    template = None if engine.chat_template else ChatTemplate.from_option("gemma" if engine.config.arch == "gemma3" else "chatml")
    engine.warm_up()
    reuse, naive, save_ms, load_ms = [], [], [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        record = run_session(engine, script.turns, script.sampling, prefix_cache=PrefixCache(1 << 30), template=template)
        reuse.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        replayed = replay_turns(engine, record, use_cache=False)
        naive.append(time.perf_counter() - t0)
        if any(diffs for _, diffs, _ in replayed):
            raise RuntimeError("the session replayed without the cache differs from the run with prefix reuse")
    cache = engine.new_cache()
    engine.forward(engine.tokenizer.encode(TEXT)[:1000], cache)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.detkv"
        for _ in range(runs):
            t0 = time.perf_counter()
            size = save_kv(path, cache, model_sha256=engine.model_file.sha256, tokenizer_sha256=engine.tokenizer.hash)
            save_ms.append((time.perf_counter() - t0) * 1e3)
            t0 = time.perf_counter()
            load_kv(path, model_sha256=engine.model_file.sha256)
            load_ms.append((time.perf_counter() - t0) * 1e3)
    return SessionFigures(
        turns=len(record.turns),
        history_tokens=sum(len(t.appended_token_ids) + len(t.generated_token_ids) for t in record.turns),
        with_reuse_s=stats(reuse), no_cache_s=stats(naive), snapshot_tokens=cache.n_tokens, snapshot_bytes=size,
        snapshot_save_ms=stats(save_ms, 1), snapshot_load_ms=stats(load_ms, 1),
    )


def lookup_figures(model: str, threads: int, runs: int, prompts: dict[str, list[int]], max_tokens: int) -> dict:
    """llama.cpp's own speculation: llama-cpp-python's prompt lookup (``LlamaPromptLookupDecoding`` as the draft
    model) against its plain decoding, greedy, on the same prompt token ids. Decode tok/s: completion tokens over
    the completion's wall time minus a prefill of the prompt alone (median of ``runs`` after one warm-up), and
    whether lookup gave the plain run's text."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    path = str(resolve_model(model))
    common = {"model_path": path, "n_ctx": 1024, "n_threads": threads, "n_threads_batch": threads, "verbose": False}
    arms = {"plain": Llama(**common), "lookup": Llama(**common, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10))}
    out = {}
    for task, ids in prompts.items():
        rates: dict[str, list[float]] = {arm: [] for arm in arms}
        texts: dict[str, str] = {}
        for run in range(runs + 1):
            for arm, llm in arms.items():
                llm.reset()
                t0 = time.perf_counter()
                llm.eval(ids)
                prefill = time.perf_counter() - t0
                llm.reset()
                t0 = time.perf_counter()
                done = llm.create_completion(ids, max_tokens=max_tokens, temperature=0.0)
                seconds = time.perf_counter() - t0 - prefill
                texts[arm] = done["choices"][0]["text"]
                if run:
                    rates[arm].append(done["usage"]["completion_tokens"] / seconds)
        out[task] = {"tokens": len(arms["plain"].tokenize(texts["plain"].encode("utf-8"), add_bos=False, special=True)),
                     "same_text": texts["lookup"] == texts["plain"], **{arm: stats(r).model_dump() for arm, r in rates.items()}}
    return out


def main(argv: list[str] | None = None) -> int:
    """Worker entry points of the suite (run by :func:`run_suite` in subprocesses)."""
    ap = argparse.ArgumentParser(description="detinfer benchmark workers (use `detinfer bench`)")
    ap.add_argument("mode", choices=["worker", "session", "lookup"])
    ap.add_argument("--engine", choices=["detinfer", "llama-cpp"], default="detinfer")
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=1, help="0: detinfer's default (threads chosen from the free cores)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--ids", choices=["text", "random"], default="text")
    ap.add_argument("--tokens", type=int, default=max(SUITE_CELLS[0]))
    ap.add_argument("--prompts", type=Path, help="lookup: a JSON file of {task: prompt token ids}")
    args = ap.parse_args(argv)
    if args.mode == "worker":
        return _serve_worker(args.engine, args.model, args.threads, args.ids, args.tokens)
    if args.mode == "lookup":
        print(json.dumps(lookup_figures(args.model, args.threads, args.runs, json.loads(args.prompts.read_text()), args.tokens)))
        return 0
    print(session_figures(args.model, args.threads, args.runs).model_dump_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())

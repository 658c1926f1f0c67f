"""Lockstep (compute/lockstep.py): many generations on one engine, their forwards run as one forward_batch per step.
Every task gets the bytes it gets alone (tokens, text, logits digests, top logits, mask digests, KV hash), whatever
runs beside it and whenever it joins: greedy and sampled decoding, a stop string, a constraint, speculation and a
prefill longer than one chunk, with fewer slots than tasks so tasks join and leave mid-run. On top of it, verify,
replay and ``detinfer batch`` give the outcomes and manifests they give one by one. The control: a reduction whose
order depends on the rows in a step is detected by the same comparison."""

from __future__ import annotations

import json
import random

import pytest

from detinfer.compute import kernels
from detinfer.compute.constrain import Constraint
from detinfer.compute.engine import DEFAULT_CHUNK, Engine
from detinfer.compute.generate import GenerationResult, generate
from detinfer.compute.lockstep import check_batch, lockstep
from detinfer.compute.sampling import Sampling, SamplingOverrides
from detinfer.compute.threads import fixed_threads
from detinfer.errors import InputError
from detinfer.integrations.batch import WorkerState, batch_lockstep, batch_task, read_batch
from detinfer.records.engines import EngineCache
from detinfer.records.manifest import tokens_sha256, write_manifest
from detinfer.records.outcome import BAD_INPUT, MATCH, MISMATCH
from detinfer.records.run import build_prompt, execute
from detinfer.records.selftest import _rmsnorm_reassociated
from detinfer.records.session import ScriptTurn, load_session, run_session, write_session
from detinfer.records.verify import ReplayOptions, read_all, reexecute_all

LIST = "apples, pears, plums, cherries, grapes, lemons, limes, figs, dates, melons"
LONG = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(12))  # > one prefill chunk
JOBS = [  # (user text, sampling, constraint, speculate)
    ("The capital of France is", Sampling(max_tokens=20), None, None),
    (f"Repeat this list exactly: {LIST}.", Sampling(temperature=0.8, top_p=0.95, seed=7, max_tokens=28), None, "ngram"),
    ("Name three colors.", Sampling(temperature=0.8, seed=3, max_tokens=24, stop=("blue",)), None, None),
    ("Give me a JSON object with a city.", Sampling(temperature=0.8, seed=5, max_tokens=24),
     Constraint.create("json_schema", json.dumps({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})),
     None),
    (f"Summarize: {LONG}", Sampling(max_tokens=12), None, None),
    ("Count from one to ten.", Sampling(max_tokens=3), None, "ngram"),
    ("Hi", Sampling(temperature=1.2, seed=11, max_tokens=16, repetition_penalty=1.3), None, None),
]  # fmt: skip


@pytest.fixture(scope="module")
def engine(model_path) -> Engine:
    with fixed_threads(1):
        yield Engine.load(model_path, n_ctx=512)


def _fields(res: GenerationResult) -> dict:
    return {k: getattr(res, k) for k in ("tokens", "text", "stop_reason", "digests", "top", "logprobs", "mask_digests", "kv_sha256")}


def _job(text: str, sampling: Sampling, constraint, speculate):
    """A task: one chat generation, on whatever engine it is given (the engine itself or a lockstep view)."""

    def run(engine: Engine) -> dict:
        res = GenerationResult()
        prompt = build_prompt(engine, messages=[{"role": "user", "content": text}]).token_ids
        for _ in generate(engine, prompt, sampling, result=res, constraint=constraint, speculate=speculate, logprobs_k=2):
            pass
        return _fields(res)

    return run


@pytest.fixture(scope="module")
def alone(engine) -> list[dict]:
    with fixed_threads(1):
        return [_job(*j)(engine) for j in JOBS]


@pytest.mark.parametrize("batch", [2, 3, 8])
def test_every_task_gets_its_bytes_alone_beside_any_others(engine, alone, batch):
    order = random.Random(batch).sample(range(len(JOBS)), len(JOBS))
    finished = []
    with fixed_threads(1):
        got = lockstep(engine, [_job(*JOBS[i]) for i in order], batch=batch, on_result=lambda k, _: finished.append(k))
    assert [got[k] == alone[i] for k, i in enumerate(order)] == [True] * len(JOBS), order
    assert sorted(finished) == list(range(len(JOBS)))
    assert all(r["tokens"] for r in alone) and alone[3]["mask_digests"]  # the jobs really generated, one constrained
    assert len(engine.tokenizer.encode(LONG)) > DEFAULT_CHUNK  # one prefill runs in several steps


def test_negative_control_a_reduction_that_depends_on_the_rows_in_a_step_is_detected(engine, alone, monkeypatch):
    original = kernels.rmsnorm_tokens
    monkeypatch.setattr(kernels, "rmsnorm_tokens", lambda x, w, eps, out: (
        _rmsnorm_reassociated if x.shape[0] > 1 else original)(x, w, eps, out))  # fmt: skip
    with fixed_threads(1):
        got = lockstep(engine, [_job(*j) for j in JOBS[:4]], batch=4)
    assert got[0] != alone[0]  # decode rows alone never reach the per-token kernels; beside others they do


def test_a_refused_forward_fails_its_task_only(engine, alone):
    def refused(view: Engine) -> str:
        try:
            view.forward([engine.config.n_vocab], view.new_cache())
        except InputError as e:
            return str(e)
        return "ran"

    with fixed_threads(1):
        got = lockstep(engine, [_job(*JOBS[0]), refused, _job(*JOBS[2])], batch=3)
    assert got[0] == alone[0] and got[2] == alone[2]
    assert "outside the vocabulary" in got[1]


def test_an_unexpected_error_stops_the_run_and_is_raised(engine):
    def broken(view: Engine):
        view.forward([1, 2], view.new_cache())
        raise RuntimeError("a bug in a task")

    with pytest.raises(RuntimeError, match="a bug in a task"):
        lockstep(engine, [_job(*JOBS[0]), broken], batch=2)
    for bad in (0, -1, True, 1.5):
        with pytest.raises(InputError, match="--batch must be at least 1"):
            check_batch(bad)


# ------------------------------------------------------------------------------- verify, replay and batch files


def _comparable(outcome) -> tuple:
    """What verify reports of a file, but for timings and the prefix reuse of sessions run side by side."""
    turns = [{k: v for k, v in row.items() if k != "reused_tokens"} for row in outcome.turns or []]
    return outcome.path, outcome.status, outcome.message, outcome.steps, outcome.differences, outcome.divergence, turns


@pytest.fixture(scope="module")
def records(engine, model_path, tmp_path_factory):
    """Manifests (one edited to a wrong token, re-sealed), three recorded sessions (one with a wrong recorded KV hash)
    and a file that is not JSON."""
    folder = tmp_path_factory.mktemp("lockstep")
    with fixed_threads(1):
        for i, (text, sampling, constraint, _) in enumerate(JOBS):
            m = execute(engine, build_prompt(engine, messages=[{"role": "user", "content": text}]), sampling, constraint=constraint)
            if i == 2:
                ids = list(m.output.token_ids)
                ids[4] = (ids[4] + 1) % engine.config.n_vocab
                output = m.output.model_copy(update={"token_ids": ids, "tokens_sha256": tokens_sha256(ids)})
                m = m.model_copy(update={"output": output}).sealed()
            write_manifest(m, folder / f"run{i}.json")
        for i, texts in enumerate([["Hi", "Tell me a joke."], ["What is 2+2?", "And 3+3?", "Thanks."], [f"Repeat: {LIST}"]]):
            turns = [ScriptTurn(messages=[{"role": "user", "content": t}]) for t in texts]
            record = run_session(engine, turns, SamplingOverrides(max_tokens=10 + 3 * i))
            if i == 1:
                turn = record.turns[1].model_copy(update={"kv_sha256": "0" * 64})
                record = record.model_copy(update={"turns": [record.turns[0], turn, *record.turns[2:]]}).sealed()
            write_session(record, folder / f"session{i}.json")
    (folder / "broken.json").write_text("{not json")
    load_session(folder / "session1.json")  # the edited session is a valid record: only an output is wrong
    return sorted(folder.glob("*.json"))


def test_verify_in_lockstep_reports_what_one_by_one_reports(records, model_path):
    with fixed_threads(1):
        one = reexecute_all(read_all(records), EngineCache(str(model_path)), batch=1)
        together = reexecute_all(read_all(records), EngineCache(str(model_path)), batch=4)
        again = reexecute_all(read_all(records), EngineCache(str(model_path)), ReplayOptions(use_cache=False), batch=8)
    status = {o.path.rsplit("/", 1)[-1]: o.status for o in one}
    assert status == {"broken.json": BAD_INPUT, "run2.json": MISMATCH, "session1.json": MISMATCH,
                      **{f"run{i}.json": MATCH for i in (0, 1, 3, 4, 5, 6)}, "session0.json": MATCH, "session2.json": MATCH}  # fmt: skip
    assert [_comparable(o) for o in together] == [_comparable(o) for o in one]
    assert [_comparable(o) for o in again] == [_comparable(o) for o in one]


def test_a_batch_file_in_lockstep_writes_the_manifests_of_one_by_one(model_path, tmp_path):
    lines = [{"id": f"q{i}", "messages": [{"role": "user", "content": text}], "sampling": sampling.model_dump(mode="json")}
             for i, (text, sampling, constraint, _) in enumerate(JOBS) if constraint is None]  # fmt: skip
    lines += [{"id": "bad", "prompt": "x", "sampling": {"max_tokens": 0}}, {"id": "nomodel", "prompt": "x", "model": str(tmp_path / "no.gguf")}]
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(line) for line in lines))
    items = read_batch(tmp_path / "b.jsonl", model=str(model_path), n_ctx=512)
    with fixed_threads(1):
        state = WorkerState()
        one = [batch_task(state, item) for item in items]
        together = batch_lockstep(items, lambda i, r: None, batch=3)
    assert [(r.id, r.status, r.message, r.manifest) for r in together] == [(r.id, r.status, r.message, r.manifest) for r in one]
    assert [r.status for r in one].count("written") == len(lines) - 2 and one[-1].status == BAD_INPUT == one[-2].status

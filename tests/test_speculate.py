"""Speculative decoding (prompt lookup) gives the bytes of plain decoding: tokens, logits digests, top logits,
logprobs, mask digests, KV digest, text and stop reason, at temperature 0 and 0.8 with top-p, with a constraint,
stop strings, max_tokens and the end of the context; a consumer that stops early leaves the same cache. Each
comparison is of a run in which drafts were taken (acceptance counted), and a rollback that forgets to truncate is
detected."""

from __future__ import annotations

import json
import re

import pytest
from cli_helpers import cli, one_error_line
from fastapi.testclient import TestClient

from detinfer.compute.constrain import Constraint
from detinfer.compute.engine import Engine
from detinfer.compute.generate import GenerationResult, generate
from detinfer.compute.kvcache import KVCache
from detinfer.compute.sampling import Sampling
from detinfer.compute.speculate import K_MAX, K_START, PAUSE_MAX, DraftPolicy, NgramDrafter
from detinfer.compute.threads import fixed_threads
from detinfer.errors import InputError
from detinfer.records.manifest import load_manifest
from detinfer.records.run import build_prompt
from detinfer.records.session import load_session
from detinfer.serve.app import create_app
from detinfer.serve.serving import ServerSettings

LIST = "apples, pears, plums, cherries, grapes, lemons, limes, figs, dates, melons"
TOOL_RESULT = json.dumps({"city": "Paris", "temperature_c": 17, "conditions": "light rain", "wind_kmh": 12})
REPEAT = f"Repeat this list exactly: {LIST}.\nRepeat this JSON exactly: {TOOL_RESULT}"
FREE = "Write a short poem about the sea."


@pytest.fixture(scope="module")
def engine(model_path) -> Engine:
    with fixed_threads(1):
        yield Engine.load(model_path, n_ctx=512)


def run(engine: Engine, text: str, sampling: Sampling, speculate: str | None, **kw) -> GenerationResult:
    res = GenerationResult()
    prompt = build_prompt(engine, messages=[{"role": "user", "content": text}]).token_ids
    for _ in generate(engine, prompt, sampling, result=res, speculate=speculate, logprobs_k=3, **kw):
        pass
    return res


def fields(res: GenerationResult) -> dict:
    return {k: getattr(res, k) for k in ("tokens", "text", "stop_reason", "digests", "top", "logprobs", "mask_digests", "kv_sha256")}


SETTINGS = {
    "greedy": (Sampling(max_tokens=96), {}),
    "t0.8-top_p": (Sampling(temperature=0.8, top_p=0.95, seed=7, max_tokens=96), {}),
    "stop": (Sampling(temperature=0.8, seed=3, max_tokens=96, stop=("melons",)), {}),
    "json_schema": (Sampling(temperature=0.8, seed=5, max_tokens=96),
                    {"constraint": Constraint.create("json_schema", json.dumps({"type": "object", "properties": {"list": {"type": "string"}}, "required": ["list"]}))}),
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_speculation_gives_the_bytes_of_plain_decoding(engine, name):
    sampling, kw = SETTINGS[name]
    plain = run(engine, REPEAT, sampling, None, **kw)
    spec = run(engine, REPEAT, sampling, "ngram", **kw)
    assert spec.accepted_tokens > 0 and spec.draft_tokens >= spec.accepted_tokens  # drafts were really taken
    assert plain.draft_tokens == 0
    assert fields(spec) == fields(plain)


def test_free_text_and_the_end_of_the_context(engine, model_path):
    sampling = Sampling(temperature=0.8, seed=11, max_tokens=96)
    assert fields(run(engine, FREE, sampling, "ngram")) == fields(run(engine, FREE, sampling, None))
    short = Engine.load(model_path, n_ctx=128)  # the context fills mid-draft: drafts shrink to what fits
    to_the_end = Sampling(max_tokens=200, ignore_eos=True)
    long = run(short, REPEAT, to_the_end, "ngram")
    assert long.stop_reason == "length" and long.accepted_tokens > 0
    assert fields(long) == fields(run(short, REPEAT, to_the_end, None))


def test_a_consumer_that_stops_early_leaves_the_cache_of_plain_decoding(engine):
    prompt = build_prompt(engine, messages=[{"role": "user", "content": REPEAT}]).token_ids
    digests = []
    for speculate in (None, "ngram"):
        cache = engine.new_cache()
        res = GenerationResult()
        steps = generate(engine, prompt, Sampling(max_tokens=96, ignore_eos=True), cache=cache, result=res, speculate=speculate)
        for _, _ in zip(range(40), steps):
            pass
        steps.close()
        digests.append((cache.n_tokens, cache.tokens, cache.digest()))
    assert res.accepted_tokens > 0 and res.draft_tokens > res.accepted_tokens  # drafts were in the cache past step 40
    assert digests[0] == digests[1] and digests[0][0] == len(prompt) + 39


def test_negative_control_a_rollback_that_keeps_rejected_drafts_is_detected(engine, monkeypatch):
    sampling = Sampling(temperature=0.8, seed=7, max_tokens=96)
    plain = run(engine, REPEAT, sampling, None)
    truncate = KVCache.truncate
    monkeypatch.setattr(KVCache, "truncate", lambda self, n: truncate(self, min(self.n_tokens, n + 1)))  # one rejected draft kept
    broken = run(engine, REPEAT, sampling, "ngram")
    assert broken.draft_tokens > broken.accepted_tokens  # a draft was rejected: the broken rollback ran
    assert fields(broken) != fields(plain)


def test_unknown_speculate_is_bad_input(engine):
    with pytest.raises(InputError, match="--speculate 'medusa'.*ngram"):
        run(engine, FREE, Sampling(max_tokens=4), "medusa")


def test_ngram_drafter_takes_the_latest_occurrence_of_the_longest_suffix():
    tokens = [1, 2, 3, 9, 1, 2, 4, 7, 2, 3, 8, 1, 2]
    d = NgramDrafter(tokens)
    assert d.draft(3) == [4, 7, 2]  # "1 2" last seen before position 6; "1 2" alone, as "x 1 2" never recurs
    tokens.append(3)  # "1 2 3" occurred at the start
    assert d.draft(2) == [9, 1]
    tokens[:] = [5, 6]
    assert NgramDrafter(tokens).draft(4) == []  # nothing seen twice
    assert NgramDrafter([7, 7]).draft(4) == [7]  # the continuation ends at the context's end


def test_draft_policy_grows_on_hits_shrinks_and_pauses_on_misses():
    p = DraftPolicy()
    assert p.size() == K_START
    p.taken(K_START, K_START)
    assert p.size() == 2 * K_START
    for _ in range(4):
        p.taken(p.k, p.k)
    assert p.size() == K_MAX
    p.taken(K_MAX, 2)
    assert p.size() == 3
    p.taken(3, 0)
    assert [p.size() for _ in range(2)] == [0, 3]  # paused one step
    p.taken(3, 0)
    assert [p.size() for _ in range(3)] == [0, 0, 3]
    for _ in range(10):
        p.taken(3, 0)
    assert [p.size() for _ in range(PAUSE_MAX + 1)] == [0] * PAUSE_MAX + [3]


# ------------------------------------------------------------------------------------------ CLI and sessions


def test_a_manifest_recorded_with_speculation_verifies_without_it_and_the_reverse(model_path, tmp_path):
    home = tmp_path / "home"
    base = ("run", "--model", model_path, "--ctx", "512", "--chat", "--prompt", REPEAT, "--max-tokens", "64",
            "--ignore-eos", "--quiet")
    r = cli(home, *base, "--speculate", "ngram", "--out", tmp_path / "spec.json")
    assert r.exit_code == 0, r.output
    assert re.search(r"drafts taken [1-9]\d* of \d+", r.stderr), r.stderr  # speculation ran and drafts were taken
    assert cli(home, *base, "--out", tmp_path / "plain.json").exit_code == 0
    spec, plain = (load_manifest(tmp_path / f"{n}.json") for n in ("spec", "plain"))
    assert spec.output == plain.output and spec.section_sha256 == plain.section_sha256  # the whole contract
    assert cli(home, "run", "--manifest", tmp_path / "spec.json", "--model", model_path, "--quiet").exit_code == 0
    r = cli(home, "run", "--manifest", tmp_path / "plain.json", "--model", model_path, "--quiet", "--speculate", "ngram")
    assert r.exit_code == 0 and "match" in r.stderr, r.output
    one_error_line(cli(home, *base, "--speculate", "medusa"), "--speculate 'medusa'", "ngram")


@pytest.fixture
def drafts(monkeypatch) -> list[int]:
    """The length of every draft a drafter proposes (to show an option reached generate)."""
    made: list[int] = []
    draft = NgramDrafter.draft
    monkeypatch.setattr(NgramDrafter, "draft", lambda self, k: made.append(len(d := draft(self, k))) or d)
    return made


def test_a_session_run_with_speculation_replays_without_it_and_the_reverse(model_path, tmp_path, drafts):
    home = tmp_path / "home"
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"sampling": {"max_tokens": 48, "temperature": 0.7, "seed": 2}, "turns": [
        {"messages": [{"role": "user", "content": REPEAT}]},
        {"messages": [{"role": "user", "content": "Now repeat the list once more."}]}]}))
    r = cli(home, "session", "run", script, "--model", model_path, "--ctx", "1024", "--speculate", "ngram", "--out", tmp_path / "s.json", "--quiet")
    assert r.exit_code == 0, r.output
    assert any(drafts)
    drafts.clear()
    r2 = cli(home, "session", "run", script, "--model", model_path, "--ctx", "1024", "--out", tmp_path / "p.json", "--quiet")
    assert r2.exit_code == 0, r2.output
    spec, plain = load_session(tmp_path / "s.json"), load_session(tmp_path / "p.json")
    assert [(t.generated_token_ids, t.logits_digests, t.kv_sha256) for t in spec.turns] == \
           [(t.generated_token_ids, t.logits_digests, t.kv_sha256) for t in plain.turns]
    assert not drafts
    for path, extra in ((tmp_path / "s.json", ()), (tmp_path / "p.json", ("--speculate", "ngram"))):
        r = cli(home, "replay", path, "--model", model_path, "--json", *extra)
        assert r.exit_code == 0 and [row["result"] for row in json.loads(r.stdout)] == ["match", "match"], r.output
        assert any(drafts) == bool(extra)
        drafts.clear()


def test_the_server_answers_with_the_bytes_of_plain_decoding(engine, drafts):
    body = {"model": "m", "messages": [{"role": "user", "content": REPEAT}], "max_tokens": 64, "temperature": 0.8,
            "seed": 9, "logprobs": True, "top_logprobs": 2}
    answers = []
    for speculate in (None, "ngram"):
        with TestClient(create_app(engine, ServerSettings(aliases=("m",), threads=1, speculate=speculate))) as client:
            r = client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            answers.append((choice, r.headers["x-detinfer-output-sha256"], r.headers["x-detinfer-kv-sha256"]))
        assert any(drafts) == bool(speculate)
    assert answers[0] == answers[1]

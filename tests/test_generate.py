"""The generation loop with the real model: stream vs result, stop reasons, stop strings, UTF-8, prompt limits,
greedy and seeded sampling against a teacher-forced forward pass.

Prompts and stop strings are picked from the model's own greedy output at run time, so the tests hold for
any numerics that keep the engine self-consistent; a failure names the step or token that broke.
Runs at one numba thread: results do not depend on it (tests/test_kernels.py), and a second thread only
slows things down on a shared machine.
"""

from __future__ import annotations

import numpy as np
import pytest

from detinfer.compute.engine import Engine
from detinfer.compute.generate import (
    DIGEST_SEED,
    GenerationResult,
    Step,
    chain_digest,
    generate,
)
from detinfer.compute.sampler import sample, top_logits
from detinfer.compute.sampling import Sampling
from detinfer.compute.threads import fixed_threads
from detinfer.errors import InputError
from detinfer.records.run import build_prompt

GREEDY = Sampling()
SAMPLED = Sampling(temperature=0.9, top_k=40, top_p=0.95, repetition_penalty=1.1, seed=1234)
PARIS = "The capital of France is"
EMOJI = "My favorite emoji is"
LONG = "The quick brown fox jumps over the lazy dog while the farmer counts sheep in the green valley below."


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with fixed_threads(1):
        yield


@pytest.fixture(scope="module")
def engine(model_path) -> Engine:
    return Engine.load(model_path, n_ctx=128)


@pytest.fixture(scope="module")
def small(model_path) -> Engine:
    return Engine.load(model_path, n_ctx=16)


def with_limits(params: Sampling, kw: dict) -> Sampling:
    """``params`` with the limits (max_tokens, stop, ignore_eos) taken out of generate keyword arguments ``kw``."""
    limits = {k: kw.pop(k) for k in ("max_tokens", "stop", "ignore_eos") if k in kw}
    return Sampling.create(**{**params.model_dump(), **limits})


def run(engine: Engine, tokens, params=GREEDY, **kw) -> tuple[list[Step], GenerationResult]:
    res = GenerationResult()
    steps = list(generate(engine, tokens, with_limits(params, kw), result=res, **kw))
    return steps, res


def streamed(steps: list[Step]) -> str:
    return "".join(s.text for s in steps)


@pytest.fixture(scope="module")
def paris(engine):
    """(prompt, steps, result) of 12 greedy tokens after PARIS."""
    prompt = engine.tokenizer.encode(PARIS)
    return (prompt, *run(engine, prompt, max_tokens=12))


def test_stream_equals_result_and_max_tokens_is_exact(engine, paris):
    prompt, steps, res = paris
    assert len(res.tokens) == 12 and res.stop_reason == "max_tokens"
    assert [s.token for s in steps] == res.tokens
    assert [s.index for s in steps] == list(range(12))
    assert [s.position for s in steps] == list(range(len(prompt), len(prompt) + 12))
    assert [s.stop_reason for s in steps] == [None] * 11 + ["max_tokens"]
    assert [s.digest for s in steps] == res.digests and [s.top for s in steps] == res.top
    assert streamed(steps) == res.text == engine.tokenizer.decode(res.tokens)
    # a shorter run is the exact prefix: max_tokens cuts, it does not change what comes before
    steps5, res5 = run(engine, prompt, max_tokens=5)
    assert res5.tokens == res.tokens[:5] and res5.stop_reason == "max_tokens" and len(steps5) == 5
    assert streamed(steps5) == res5.text == engine.tokenizer.decode(res.tokens[:5])
    assert res5.digests == res.digests[:5]


def pick_stop(engine: Engine, tokens: list[int]) -> tuple[str, int, int]:
    """A stop string spanning 3 generated tokens and starting inside the first of them.

    Returns (stop, index of the token that completes it, character offset where it starts in the text).
    """
    tok = engine.tokenizer
    full = tok.decode(tokens)
    for i in range(1, len(tokens) - 2):
        pieces = [tok.decode([t]) for t in tokens[i : i + 3]]
        if len(pieces[0]) < 2 or not all(pieces) or not all(p.isascii() for p in pieces):
            continue
        start = len(tok.decode(tokens[:i])) + 1
        stop = "".join(pieces)[1:]
        if full.find(stop) == start:
            return stop, i + 2, start
    pytest.fail(f"no 3-token stop string found in the greedy output {full!r}; pick another prompt")


@pytest.mark.parametrize("cut", ["beyond", "at_max_tokens"])
def test_stop_string_spanning_tokens_is_never_emitted(engine, paris, cut):
    prompt, _, res = paris
    stop, last, start = pick_stop(engine, res.tokens)
    # "at_max_tokens": the stop completes on the last allowed token; "stop" wins over "max_tokens"
    max_tokens = 12 if cut == "beyond" else last + 1
    steps, got = run(engine, prompt, max_tokens=max_tokens, stop=["never-appears", stop])
    assert got.stop_reason == "stop" and steps[-1].stop_reason == "stop", f"stop {stop!r}: {got.stop_reason}"
    assert got.tokens == res.tokens[: last + 1], f"stop {stop!r} completes at token {last}"
    # Exactly the text before the stop string, in the stream and in the result: no part of the stop leaks
    # out, and the characters of its first token that precede it are still emitted.
    assert streamed(steps) == got.text == res.text[:start], f"stop {stop!r}"


def test_held_back_stop_prefix_is_released_at_max_tokens(engine, paris):
    prompt, _, res = paris
    text2 = engine.tokenizer.decode(res.tokens[:2])
    stop = text2 + "\x00never"  # everything generated is a prefix of the stop, so all of it is held back
    steps, got = run(engine, prompt, max_tokens=2, stop=[stop])
    assert got.stop_reason == "max_tokens"
    assert [s.text for s in steps[:-1]] == [""], "text that may still become a stop string was emitted early"
    assert streamed(steps) == got.text == text2


def split_char_cuts(engine: Engine, tokens: list[int]) -> list[int]:
    """Token counts n at which the bytes of tokens[:n] end inside a UTF-8 character."""
    cuts = []
    data = b""
    for n, t in enumerate(tokens, 1):
        data += engine.tokenizer.token_bytes(t)
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            cuts.append(n)
    return cuts


def test_emoji_split_at_max_tokens_gives_no_replacement_character(engine):
    prompt = engine.tokenizer.encode(EMOJI)
    _, full = run(engine, prompt, max_tokens=10)
    cuts = split_char_cuts(engine, full.tokens)
    if not cuts:
        pytest.fail(f"greedy output {full.text!r} of {EMOJI!r} splits no character across tokens; pick another prompt")
    assert "\ufffd" not in full.text
    for n in cuts[:2]:
        steps, got = run(engine, prompt, max_tokens=n)
        assert got.tokens == full.tokens[:n] and got.stop_reason == "max_tokens"
        whole = b"".join(engine.tokenizer.token_bytes(t) for t in got.tokens).decode("utf-8", errors="ignore")
        assert "\ufffd" not in streamed(steps) and "\ufffd" not in got.text, f"cut after {n} tokens: {got.text!r}"
        assert streamed(steps) == got.text == whole, f"cut after {n} tokens"


# ---- prompt limits (n_ctx = 16) ----------------------------------------------------------------------


def long_tokens(engine: Engine, n: int) -> list[int]:
    ids = engine.tokenizer.encode(LONG)
    assert len(ids) > n
    return ids[:n]


def test_prompt_one_short_of_context_generates_one_token(small):
    steps, res = run(small, long_tokens(small, 15), max_tokens=8)
    assert len(steps) == 1 and steps[0].token is not None and steps[0].position == 15
    assert res.tokens == [steps[0].token] and res.stop_reason == "length" == steps[0].stop_reason
    assert streamed(steps) == res.text == small.tokenizer.decode(res.tokens)


def test_generation_stops_at_end_of_context(small):
    steps, res = run(small, long_tokens(small, 12), max_tokens=10)
    assert len(res.tokens) == 4 and [s.position for s in steps] == [12, 13, 14, 15]  # positions < n_ctx only
    assert res.stop_reason == "length" and [s.stop_reason for s in steps] == [None, None, None, "length"]
    assert streamed(steps) == res.text == small.tokenizer.decode(res.tokens)


def test_prompt_filling_context_stops_before_sampling(small):
    steps, res = run(small, long_tokens(small, 16), max_tokens=8)
    assert len(steps) == 1
    s = steps[0]
    assert (s.token, s.index, s.position, s.text, s.stop_reason) == (None, 0, 16, "", "length")
    assert res.tokens == [] and res.text == "" and res.stop_reason == "length"


@pytest.mark.parametrize(
    "case, match",
    [("too_long", "17 tokens"), ("empty", "empty"), ("max_tokens_0", "max_tokens=0"),
     ("bad_token_id", "outside the vocabulary"), ("chunk_size_0", "--chunk-size must be at least 1")],
)  # fmt: skip
def test_invalid_requests_raise_input_error_and_engine_stays_usable(small, case, match):
    before = run(small, long_tokens(small, 14), max_tokens=2)[1]
    prompt, kw = long_tokens(small, 5), {"max_tokens": 4}
    if case == "too_long":
        prompt = long_tokens(small, 17)
    elif case == "empty":
        prompt = []
    elif case == "max_tokens_0":
        kw["max_tokens"] = 0
    elif case == "bad_token_id":
        prompt = prompt[:3] + [small.config.n_vocab] + prompt[3:]
    else:
        kw["chunk_size"] = 0
    with pytest.raises(InputError, match=match):  # generate is lazy: the error comes with the first step
        list(generate(small, prompt, with_limits(GREEDY, kw), **kw))
    after = run(small, long_tokens(small, 14), max_tokens=2)[1]
    assert (after.tokens, after.digests, after.kv_sha256) == (before.tokens, before.digests, before.kv_sha256)


# ---- against a teacher-forced forward pass ------------------------------------------------------------


def teacher_forced(engine: Engine, prompt: list[int], tokens: list[int]):
    """Logits at the positions that sampled ``tokens`` ([len(tokens), n_vocab]) from one prefill, and its cache."""
    cache = engine.new_cache()
    logits = engine.forward(prompt + tokens[:-1], cache, all_logits=True)
    return logits[len(prompt) - 1 :], cache


def test_greedy_equals_argmax_of_teacher_forced_pass(engine, paris):
    prompt, steps, res = paris
    logits, cache = teacher_forced(engine, prompt, res.tokens)
    digest = DIGEST_SEED
    for i, row in enumerate(logits):
        digest = chain_digest(digest, row)
        assert int(np.argmax(row)) == res.tokens[i], f"step {i}: generated {res.tokens[i]}, argmax {np.argmax(row)}"
        # decode logits are the same bytes as prefill logits at that position
        assert digest == res.digests[i], f"step {i}: logits differ from the teacher-forced pass"
        assert top_logits(row, 5) == res.top[i], f"step {i}"
    assert cache.digest() == res.kv_sha256, "KV cache after generation differs from the teacher-forced prefill"


def test_seeded_sampling_is_reproducible_and_each_step_recomputable(engine):
    prompt = engine.tokenizer.encode(PARIS)
    steps, res = run(engine, prompt, SAMPLED, max_tokens=10)
    again = run(engine, prompt, SAMPLED, max_tokens=10)[1]
    assert (again.tokens, again.digests, again.text) == (res.tokens, res.digests, res.text)
    logits, _ = teacher_forced(engine, prompt, res.tokens)
    for i, row in enumerate(logits):
        p = len(prompt) + i
        assert steps[i].position == p
        got = sample(row, SAMPLED, p, prompt + res.tokens[:i])
        assert got == res.tokens[i], f"step {i} (position {p}): recomputed {got}, generated {res.tokens[i]}"


# ---- end of generation --------------------------------------------------------------------------------


def test_eos_ends_generation_and_ignore_eos_continues(engine):
    prompt = build_prompt(engine, text="What is 2+2? Answer with one number.", chat=True).token_ids
    steps, res = run(engine, prompt, max_tokens=32)
    tok = engine.tokenizer
    assert res.stop_reason == "eos", f"no end-of-generation token in 32: {res.text!r}"
    n = len(res.tokens)
    assert res.tokens[-1] in tok.eog_ids and all(t not in tok.eog_ids for t in res.tokens[:-1])
    assert steps[-1].stop_reason == "eos" and steps[-1].text == ""
    assert streamed(steps) == res.text == tok.decode(res.tokens[:-1]), "the EOS token must not be emitted as text"
    assert res.text.strip(), "the answer is empty"

    steps2, cont = run(engine, prompt, max_tokens=n + 1, ignore_eos=True)
    assert cont.stop_reason == "max_tokens" and len(cont.tokens) == n + 1
    assert cont.tokens[:n] == res.tokens and cont.digests[:n] == res.digests
    assert streamed(steps2) == cont.text == tok.decode(cont.tokens)
    assert cont.text.startswith(res.text + tok.token_text(res.tokens[-1]))

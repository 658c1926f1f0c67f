"""Token-stream records and reports without a model: the divergence report's branches, JUnit XML, GitHub
annotation escaping and the CI cache key."""

from __future__ import annotations

import platform
import re
import xml.etree.ElementTree as ET

import pytest

from detinfer.compute import jit_cache
from detinfer.integrations.ci_report import (
    cache_key,
    cache_target,
    github_annotations,
    junit_xml,
)
from detinfer.integrations.snapshot import TokenStreamExtension
from detinfer.records.outcome import BAD_INPUT, MATCH, MISMATCH, Divergence
from detinfer.records.outcome import Outcome as VerifyResult
from detinfer.records.tokenstream import divergence_report

RUN = {"model_sha256": "ab" * 32, "settings": {"seed": 1, "n_ctx": 64}, "prompt_token_ids": [1, 2, 3],
       "output_token_ids": [5, 6, 7], "output_text": "xyz", "stop_reason": "eos"}


def test_equal_streams_have_no_report():
    assert divergence_report(RUN, dict(RUN)) == []


def test_the_report_names_each_kind_of_difference():
    actual = dict(RUN, model_sha256="cd" * 32, settings={"seed": 2, "n_ctx": 64}, prompt_token_ids=[1, 9, 3],
                  output_token_ids=[5, 6, 8, 4], output_text="xyw", stop_reason="max_tokens")
    lines = divergence_report(RUN, actual, token_text=lambda i: f"<{i}>", top_at=lambda turn, step: [(8, 3.5), (7, 3.25)])
    assert lines == [
        f"model_sha256: expected {'ab' * 32!r}, got {'cd' * 32!r}",
        "settings.seed: expected 1, got 2",
        "prompt token ids differ from index 1: expected 2 '<2>', got 9 '<9>'",
        "first divergent step 2 (of 3 expected, 4 generated):",
        "  expected token 7 '<7>'",
        "  actual token   8 '<8>'",
        "  top-5 logits there (actual run): 8 '<8>' 3.5000, 7 '<7>' 3.2500",
        "output_text: expected 'xyz', got 'xyw'",
        "stop_reason: expected 'eos', got 'max_tokens'",
    ]


def test_a_session_report_stops_at_the_first_divergent_turn():
    turn = {k: RUN[k] for k in ("prompt_token_ids", "output_token_ids", "output_text", "stop_reason")}
    expected = {"model_sha256": "ab", "settings": {}, "turns": [turn, turn, turn]}
    actual = dict(expected, turns=[turn, dict(turn, output_token_ids=[5, 6]), dict(turn, output_text="other")])
    assert divergence_report(expected, actual) == ["turn 2, first divergent step 2 (of 3 expected, 2 generated):",
                                                   "  expected token 7", "  actual token   (none: the stream ended)"]


def test_the_extension_refuses_other_values():
    with pytest.raises(TypeError, match="detinfer_snapshot stores detinfer results"):
        TokenStreamExtension().serialize({"text": "hi"})


def test_junit_and_annotations():
    results = [VerifyResult("a.json", MATCH, seconds=1.5),
               VerifyResult("b,c.json", MISMATCH, message="differs: output.token_ids", seconds=2.0,
                            differences=[{"field": "output.token_ids", "expected": "[1, 2]", "actual": "[1, 3]"}],
                            divergence=Divergence(1, 2, 3, "' x'", "' y'", [], [[3, 9.5]])),
               VerifyResult("d.json", BAD_INPUT, message="d.json: model sha256 differs 100%")]
    suite = ET.fromstring(junit_xml(results)).find("testsuite")
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors"), suite.get("time")) == ("3", "1", "1", "3.500")
    a, b, d = suite.iter("testcase")
    assert list(a) == [] and b.find("failure").text.splitlines() == [
        "differs: output.token_ids", "  output.token_ids: expected [1, 2] got [1, 3]",
        "  first divergent step 1: expected token 2 ' x', got 3 ' y'", "  top-5 actual   [[3, 9.5]]"]  # no "expected []"
    assert d.find("error").get("message") == "model sha256 differs 100%"
    ann = github_annotations(results)
    assert ann[0].startswith("::error file=b%2Cc.json,title=detinfer verify%3A mismatch::differs: output.token_ids%0A  output")
    assert ann[1] == "::error file=d.json,title=detinfer verify%3A bad input::model sha256 differs 100%25"


def test_cache_key_names_versions_model_and_cpu():
    level = cache_target()
    assert re.fullmatch(r"(x86-64-v[1-4]|[a-z0-9_]+)-\S+", level)
    key = cache_key()
    assert key.startswith("detinfer-0.1.0-numba-") and key.endswith(level)
    assert f"-py{platform.python_version()}-jit{jit_cache.FORMAT}-b179c9523d0e6a0f-" in key  # the sealed entries' format
    assert cache_key("gemma3-270m-q4_k_m") != key

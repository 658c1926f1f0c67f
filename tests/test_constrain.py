"""Grammar-constrained decoding on the real SmolLM2: outputs parse and validate, the mask is really applied, and a
constrained run replays bit for bit (threads, manifests, CLI, sessions); bad constraints fail before any token."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import numba
import numpy as np
import pytest
from cli_helpers import cli

from detinfer.compute.constrain import (
    MAX_CONSTRAINT_BYTES,
    Constraint,
    Guide,
    json_schema_constraint,
    tool_call_constraint,
)
from detinfer.compute.engine import Engine, set_threads
from detinfer.compute.generate import generate
from detinfer.compute.sampling import Sampling, SamplingOverrides
from detinfer.errors import ConstraintError, InputError, ManifestError
from detinfer.records.manifest import SCHEMA_VERSION, canonical_json, load_manifest
from detinfer.records.replay import replay_turns
from detinfer.records.run import build_prompt, execute, reexecute_manifest
from detinfer.records.session import ScriptTurn, load_session, run_session

PERSON = "Describe a person as JSON."
SCHEMAS = {
    "required_fields": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                        "required": ["name", "age"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
                                              "sunny": {"type": "boolean"}}, "required": ["city", "sunny"],
             "additionalProperties": False},
    "numbers": {"type": "object", "properties": {"height_m": {"type": "number", "minimum": 0, "maximum": 3},
                                                 "score": {"type": "integer", "minimum": 1, "maximum": 10}},
                "required": ["height_m", "score"], "additionalProperties": False},
    "array": {"type": "object", "properties": {"hobbies": {"type": "array", "items": {"type": "string"}, "minItems": 1,
                                                           "maxItems": 3}}, "required": ["hobbies"],
              "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "name": {"type": "string"},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["street", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False},
}  # fmt: skip


@pytest.fixture(scope="module")
def engine(model_path):
    set_threads(1)
    yield Engine.load(model_path, n_ctx=1024)
    set_threads(None)


def _run(engine, text, constraint, max_tokens=80, **sampling):
    prompt = build_prompt(engine, text=text, chat=True)
    return execute(engine, prompt, Sampling(**sampling, max_tokens=max_tokens), constraint=constraint)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_schema_constrained_output_validates(engine, name):
    schema = SCHEMAS[name]
    m = _run(engine, PERSON, json_schema_constraint(schema))
    assert m.output.stop_reason == "eos", m.output.text
    jsonschema.validate(json.loads(m.output.text), schema)
    assert len(m.output.mask_digests) == len(m.output.token_ids) == len(m.output.logits_digests)


def test_unconstrained_run_differs_and_does_not_parse(engine):
    """Negative control: the same prompt without the mask is chat prose, so the mask is what made the JSON."""
    schema = SCHEMAS["required_fields"]
    constrained = _run(engine, PERSON, json_schema_constraint(schema))
    free = _run(engine, PERSON, None)
    assert free.output.token_ids != constrained.output.token_ids
    assert free.output.mask_digests is None and free.constraint is None
    with pytest.raises(ValueError):
        json.loads(free.output.text)


def test_sampled_json_object_regex_and_lark(engine):
    sampled = _run(engine, "Give a JSON object with your name.", Constraint.create("json_object"), temperature=0.8, top_p=0.9, seed=2)
    assert sampled.output.stop_reason == "eos" and isinstance(json.loads(sampled.output.text), dict)
    regex = _run(engine, "What is 6 times 7?", Constraint.create("regex", r"[0-9]{1,3}"), temperature=0.7, seed=3)
    assert regex.output.stop_reason == "eos" and regex.output.text.isdigit()
    lark = _run(engine, "Pick a color.", Constraint.create("lark", 'start: "color: " COLOR\nCOLOR: "red" | "green" | "blue"\n'))
    assert lark.output.text in ("color: red", "color: green", "color: blue") and lark.output.stop_reason == "eos"


def test_max_tokens_cuts_a_constraint_short(engine):
    m = _run(engine, PERSON, json_schema_constraint(SCHEMAS["nested"]), max_tokens=5)
    assert m.output.stop_reason == "max_tokens" and len(m.output.token_ids) == 5


def test_same_bytes_at_one_and_two_threads_and_replay(engine):
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs 2 cores")
    recorded = _run(engine, PERSON, json_schema_constraint(SCHEMAS["enum"]), temperature=0.9, seed=5)
    set_threads(2)
    try:
        actual, comparison = reexecute_manifest(recorded, engine)
    finally:
        set_threads(1)
    assert comparison.match, comparison.differences
    assert canonical_json(actual.output.model_dump(mode="json")) == canonical_json(recorded.output.model_dump(mode="json"))


def test_mask_digest_chain_is_a_pure_function_of_grammar_and_tokens(engine):
    """Two guides fed the same tokens give the same mask digests; another grammar gives others."""
    tok = engine.tokenizer
    ids = tok.encode('{"city": "Paris", "sunny": true}', add_bos=False)
    logits = np.zeros(tok.n_vocab, np.float32)

    def chain(constraint):
        g, out = Guide(constraint, tok), []
        for t in ids:
            masked = g.mask(logits)
            assert masked[t] == 0.0, f"token {t} should be allowed"
            out.append(g.digest)
            g.consume(t)
        return out

    a = chain(json_schema_constraint(SCHEMAS["enum"]))
    assert a == chain(json_schema_constraint(SCHEMAS["enum"])) and len(set(a)) > 1
    assert a != chain(Constraint.create("json_object"))


def test_grammar_end_leaves_only_end_tokens(engine):
    tok = engine.tokenizer
    g = Guide(Constraint.create("regex", "(yes|no)"), tok)
    logits = np.zeros(tok.n_vocab, np.float32)
    g.mask(logits)
    g.consume(tok.encode("yes", add_bos=False)[0])
    allowed = np.flatnonzero(g.mask(logits) == 0.0)
    assert set(allowed.tolist()) == set(tok.eog_ids)
    assert not (tok.special_ids - tok.eog_ids) & set(np.flatnonzero(Guide(Constraint.create("json_object"), tok).mask(logits) == 0.0).tolist())


@pytest.mark.parametrize("kind, text, expected", [
    ("json_schema", '{"type": "foo"}', "Invalid type: foo"),
    ("json_schema", '{"not": {"type": "string"}}', 'Unimplemented keys: ["not"]'),
    ("json_schema", '{"type": "string", "format": "ipv9"}', "Unknown format: ipv9"),
    ("json_schema", "[1, 2]", "must be a JSON object"),
    ("json_schema", "{not json", "not valid JSON"),
    ("regex", "a(b", "unclosed group"),
    # a regex that does not parse: quoted with the reason, without the regex crate's excerpt (or, for a --regex, a place
    # in llguidance's wrapper grammar)
    ("regex", "[a-", 'invalid regex constraint: regex "[a-": unclosed character class'),
    ("lark", "start: /[a-/", 'invalid lark constraint: at 1(8): regex "[a-": unclosed character class'),
    ("json_schema", '{"type": "string", "pattern": "x{2,1}"}', 'regex "x{2,1}": invalid repetition count range'),
    ("json_schema", '{"type": "string", "pattern": "(?P<a>x)(?P<a>y)"}', 'regex "(?P<a>x)(?P<a>y)": duplicate capture group'),
    ("regex", r"[^\x00-\x{10FFFF}]", "can never be satisfied"),
    ("lark", "start: b\n", 'unknown name: "b"'),
    ("lark", "x" * (MAX_CONSTRAINT_BYTES + 1), f"the cap is {MAX_CONSTRAINT_BYTES:,} bytes"),
])  # fmt: skip
def test_bad_constraints_fail_before_any_token(engine, kind, text, expected):
    with pytest.raises(ConstraintError) as info:
        Constraint.create(kind, text).check(engine.tokenizer)
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_ignore_eos_is_refused(engine):
    with pytest.raises(ConstraintError, match="ignore-eos"):
        next(generate(engine, [1, 2, 3], Sampling(max_tokens=4, ignore_eos=True), constraint=Constraint.create("json_object")))


@pytest.mark.parametrize("markup", [("", ""), ("<tool_call>\n", "\n</tool_call>")], ids=["plain", "markup"])
def test_tool_call_constraint(engine, markup):
    weather = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["C", "F"]}},
               "required": ["city", "unit"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": weather}},
             {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
                 "a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"], "additionalProperties": False}}}]  # fmt: skip
    prefix, suffix = markup
    c = tool_call_constraint(tools, "get_weather", prefix=prefix, suffix=suffix)
    assert c.kind == ("lark" if prefix else "json_schema")
    m = _run(engine, "What is the weather in Paris?", c)
    assert m.output.stop_reason == "eos" and m.output.text.startswith(prefix) and m.output.text.endswith(suffix)
    call = json.loads(m.output.text[len(prefix): len(m.output.text) - len(suffix)])
    assert call["name"] == "get_weather"
    jsonschema.validate(call["arguments"], weather)
    anyof = _run(engine, "Add 2 and 3.", tool_call_constraint(tools))
    assert json.loads(anyof.output.text)["name"] in ("get_weather", "add")
    with pytest.raises(ConstraintError, match="not among the tools"):
        tool_call_constraint(tools, "nope")


# --------------------------------------------------------------------------------------------- CLI and records


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("detinfer-home")


def test_cli_round_trip_verify_and_edit(engine, home, model_path, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMAS["enum"]))
    out = tmp_path / "run.json"
    r = cli(home, "run", "-m", model_path, "--chat", "-p", PERSON, "--json-schema", schema, "--threads", "1", "-n", "40", "--out", out)
    assert r.exit_code == 0, r.output
    m = load_manifest(out)
    assert m.schema_version == SCHEMA_VERSION == 3 and m.constraint.kind == "json_schema"
    assert m.constraint.text == schema.read_text() and "llguidance" in m.informative.versions
    jsonschema.validate(json.loads(m.output.text), SCHEMAS["enum"])
    r = cli(home, "run", "--manifest", out, "-m", model_path, "--threads", "1", "-q")
    assert r.exit_code == 0 and "match" in r.output, r.output
    r = cli(home, "verify", out, "--model", model_path, "--threads", "1")
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    data["constraint"]["text"] = data["constraint"]["text"].replace("London", "Berlin")
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(data))
    r = cli(home, "run", "--manifest", edited, "-m", model_path)
    assert r.exit_code == 2 and "constraint" in r.output, r.output
    with pytest.raises(ManifestError, match="constraint"):
        load_manifest(edited)


@pytest.mark.parametrize("args, expected", [
    (["--json", "--regex", "a"], "give at most one constraint; got --json, --regex"),
    (["--regex", "a(b"], "invalid regex constraint"),
    (["--json", "--ignore-eos"], "drop --ignore-eos"),
    (["--grammar", "/nonexistent.lark"], "cannot read --grammar file /nonexistent.lark: file not found"),
])  # fmt: skip
def test_cli_bad_constraint_is_one_line_exit_2(home, model_path, args, expected):
    r = cli(home, "run", "-m", model_path, "-p", "hi", "--threads", "1", *args)
    assert r.exit_code == 2 and expected in r.output and "Traceback" not in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1


@pytest.mark.parametrize("content, expected", [
    ("hello\n", "the JSON Schema is not valid JSON: invalid JSON at column 1 (Expecting value)"),
    ("[1, 2]", "a JSON Schema must be a JSON object, got an array"),
])  # fmt: skip
def test_cli_bad_json_schema_file_is_named_in_its_one_line(home, model_path, tmp_path, content, expected):
    schema = tmp_path / "schema.json"
    schema.write_text(content)
    r = cli(home, "run", "-m", model_path, "-p", "hi", "--threads", "1", "--json-schema", schema)
    assert r.exit_code == 2 and r.output.strip() == f"error: --json-schema file {schema}: {expected}", r.output


def test_cli_manifest_refuses_constraint_options(home, tmp_path):
    r = cli(home, "run", "--manifest", tmp_path / "x.json", "--json")
    assert r.exit_code == 2 and "drop --json" in r.output, r.output


def test_session_turn_constraints_replay(engine, tmp_path):
    turns = [ScriptTurn.model_validate({"messages": [{"role": "user", "content": PERSON}],
                                        "constraint": {"json_schema": SCHEMAS["required_fields"]}}),
             ScriptTurn.model_validate({"messages": [{"role": "user", "content": "Is that person real?"}],
                                        "constraint": {"regex": "(yes|no)"}}),
             ScriptTurn.model_validate({"messages": [{"role": "user", "content": "Thanks."}]})]  # fmt: skip
    out = tmp_path / "session.json"
    run_session(engine, turns, SamplingOverrides(max_tokens=24, temperature=0.7, seed=2), out=out)
    record = load_session(out)
    first, second, third = record.turns
    jsonschema.validate(json.loads(first.text), SCHEMAS["required_fields"])
    assert second.text in ("yes", "no") and second.constraint.kind == "regex" and second.mask_digests
    assert third.constraint is None and "mask_digests" not in json.loads(out.read_text())["turns"][2]
    results = replay_turns(engine, record, use_cache=False)
    assert [diffs for _, diffs, _ in results] == [[], [], []]
    edited = json.loads(out.read_text())
    edited["turns"][1]["constraint"]["text"] = "(no|yes)"
    bad = tmp_path / "edited.json"
    bad.write_text(json.dumps(edited))
    with pytest.raises(ManifestError, match="constraint"):
        replay_turns(engine, load_session(bad))


def test_session_script_bad_constraint_fails_before_any_turn(engine, tmp_path):
    turns = [ScriptTurn.model_validate({"messages": [{"role": "user", "content": "hi"}]}),
             ScriptTurn.model_validate({"messages": [{"role": "user", "content": "hi"}], "constraint": {"regex": "a(b"}})]
    out = tmp_path / "s.json"
    with pytest.raises(ConstraintError, match="turn 2: invalid regex"):
        run_session(engine, turns, SamplingOverrides(max_tokens=4), out=out)
    assert not out.exists()


def test_bench_constraint_arms_decode_the_same_token_count(engine):
    from detinfer.bench.constraint import bench_constraint

    b = bench_constraint(engine, tokens=6, runs=1)
    assert len(b.free_s) == len(b.constrained_s) == 1 and min(b.free_s) > 0 and min(b.constrained_s) > 0
    assert b.overhead == min(b.constrained_s) / min(b.free_s) - 1
    with pytest.raises(InputError, match="--tokens"):
        bench_constraint(engine, tokens=1)


def test_cli_bench_constraint_bad_options_exit_2(home):
    r = cli(home, "bench", "constraint", "--runs", "0")
    assert r.exit_code == 2 and "--runs at least 1" in r.output, r.output

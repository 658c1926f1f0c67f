"""`detinfer verify`, golden token streams, manifest regeneration and the determinism matrix.

Manifests are recorded with the library (short runs at n_ctx 256) and re-executed through the CLI in-process
(typer's CliRunner, an isolated $DETINFER_HOME, the real model passed with --model). Exit codes: 0 all match,
1 a mismatch, 2 bad input — a broken, edited or foreign manifest is never reported as a mismatch.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numba
import pytest
from typer.testing import CliRunner

import golden
from detinfer.cli import app
from detinfer.compute.engine import Engine, set_threads
from detinfer.compute.kvcache import KV_QUANT_REASON
from detinfer.compute.numerics import NUMERICS
from detinfer.compute.sampling import Sampling
from detinfer.records.machine import describe, machine
from detinfer.records.manifest import (
    SCHEMA_VERSION,
    RunManifest,
    load_manifest,
    tokens_sha256,
    write_manifest,
)
from detinfer.records.run import build_prompt, excerpts, execute
from detinfer.records.selftest import matrix, probe_process
from detinfer.records.tokenstream import run_stream, stream_json
from detinfer.records.verify import MATCH
from detinfer.records.verify import verify as verify_paths
from golden import Case, run_case, write_manifests

PROMPT = "The capital of France is"
GREEDY_IDS = [7042, 30, 198, 198, 504, 2988, 314, 42]  # " Paris.\n\nThe answer is:"
STORY = (  # 40 tokens: more than one chunk of 1 and 7, fewer than one of 64
    "Once upon a time, in a small village at the edge of a great forest, there lived a wise old woman who kept bees. "
    "Every morning she walked to the river and sang to the water."
)
RUNS = {  # name: (prompt, sampling parameters, kv type); 8 tokens each, EOS ignored
    "greedy": (PROMPT, {}, "f32"),
    "sampled": ("Write a short poem about the sea.", {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "seed": 1234}, "f32"),
    "f16_kv": (PROMPT, {}, "f16"),
}

runner = CliRunner()


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty $DETINFER_HOME: no registry model is visible, so every run names its model with --model."""
    return tmp_path_factory.mktemp("detinfer-home")


@pytest.fixture(autouse=True)
def all_threads():
    """`verify --threads 1` runs in this process: give later tests their threads back."""
    yield
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)


def cli(home: Path, *args):
    return runner.invoke(app, [str(a) for a in args], env={"DETINFER_HOME": str(home), "COLUMNS": "250"})


def verify(home: Path, model_path: Path, *args):
    r = cli(home, "verify", "--model", model_path, *args)
    assert not (r.exception and not isinstance(r.exception, SystemExit)), repr(r.exception)
    assert "Traceback" not in r.output
    return r


def verify_json(home: Path, model_path: Path, *args) -> tuple[int, dict[str, dict], dict]:
    """`verify --json`: (exit code, {file name: result}, summary); every stdout line must be one JSON object."""
    r = verify(home, model_path, "--json", *args)
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    *results, summary = lines
    assert summary["summary"] is True and summary["exit_code"] == r.exit_code, r.stdout
    assert summary["files"] == len(results)
    return r.exit_code, {Path(x["path"]).name: x for x in results}, summary


def row(stdout: str, name: str) -> str:
    """The table row of the file called ``name``."""
    rows = [line for line in stdout.splitlines() if re.search(rf"[/ ]{re.escape(name)}\s*│", line)]
    assert len(rows) == 1, stdout
    return rows[0]


def report_lines(stdout: str, name: str) -> list[str]:
    """The report lines under the table for the file called ``name`` (its message line and indented details)."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(rf"/\S*/{re.escape(name)}[: ]", line))
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith("  ")), len(lines))
    return lines[start:end]


@pytest.fixture(scope="module")
def engine(model_path: Path) -> Engine:
    return Engine.load(model_path, n_ctx=256)


@pytest.fixture(scope="module")
def recorded(engine: Engine, model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of manifests recorded with the library: greedy, seeded sampling, f16 KV (8 tokens each)."""
    folder = tmp_path_factory.mktemp("recorded")
    set_threads(numba.config.NUMBA_NUM_THREADS)  # recorded with every thread, whatever else the machine runs
    engines = {"f32": engine, "f16": Engine.load(model_path, n_ctx=256, kv_type="f16")}
    for name, (text, params, kv_type) in RUNS.items():
        eng = engines[kv_type]
        sampling = Sampling(**params, max_tokens=8, ignore_eos=True)
        write_manifest(execute(eng, build_prompt(eng, text=text), sampling), folder / f"{name}.json")
    return folder


def manifest_data(recorded: Path, name: str = "greedy") -> dict:
    return json.loads((recorded / f"{name}.json").read_text())


def with_output(m: RunManifest, **update) -> RunManifest:
    """``m`` with output fields replaced (token ids keep their hash consistent) and sealed again: a valid record."""
    if "token_ids" in update:
        update["tokens_sha256"] = tokens_sha256(update["token_ids"])
    return m.model_copy(update={"output": m.output.model_copy(update=update)}).sealed()


def test_recorded_runs(recorded: Path):
    greedy = load_manifest(recorded / "greedy.json")
    assert greedy.output.token_ids == GREEDY_IDS
    sampled = load_manifest(recorded / "sampled.json")
    assert sampled.sampling.seed == 1234 and sampled.sampling.temperature == 0.8
    f16 = load_manifest(recorded / "f16_kv.json")
    assert f16.engine.kv_type == "f16" and f16.output.kv_sha256 != greedy.output.kv_sha256
    for m in (greedy, sampled, f16):
        assert len(m.output.token_ids) == len(m.output.logits_digests) == len(m.output.top_logits) == 8
        assert m.informative.threads == numba.config.NUMBA_NUM_THREADS  # recorded with every thread


# ------------------------------------------------------------------------------------------ matching runs


def test_verify_folder_all_match(home: Path, model_path: Path, recorded: Path):
    r = verify(home, model_path, recorded)
    assert r.exit_code == 0, r.output
    for name in RUNS:
        assert re.search(r"│\s*smollm2-135m-instruct-q4_1\s*│\s*8\s*│\s*match\s*│", row(r.stdout, f"{name}.json")), r.stdout
    assert "mismatch" not in r.stdout and "bad input" not in r.stdout
    # one summary line; the files of one model ran side by side (--batch 8), so their times overlap; not with --batch 1
    assert re.search(rf"^{len(RUNS)} files: {len(RUNS)} match in \d+\.\d s \(files ran side by side, so their times overlap\)$",
                     r.stdout, re.M), r.stdout  # fmt: skip
    r = verify(home, model_path, recorded, "--batch", "1")
    assert re.search(rf"^{len(RUNS)} files: {len(RUNS)} match in \d+\.\d s$", r.stdout, re.M), r.stdout


def test_verify_json_with_one_thread(home: Path, model_path: Path, recorded: Path):
    # recorded with all threads, re-executed with one: threads are informative, never compared
    code, results, summary = verify_json(home, model_path, recorded, "--threads", "1")
    assert code == 0
    assert summary == {"summary": True, "files": 3, "match": 3, "mismatch": 0, "bad_input": 0, "exit_code": 0}
    assert sorted(results) == sorted(f"{name}.json" for name in RUNS)
    for name, res in results.items():
        assert res["status"] == "match", res
        assert res["threads"] == 1, res
        assert res["steps"] == 8 and res["model"] == "smollm2-135m-instruct-q4_1"
        assert res["differences"] == [] and res["divergence"] is None and res["message"] == ""
    # in lockstep by engine (model, n_ctx, kv type): the two f32 files ran beside each other, the f16 one alone
    assert {name: res["overlapped"] for name, res in results.items()} == {"greedy.json": True, "sampled.json": True, "f16_kv.json": False}
    _, results, _ = verify_json(home, model_path, recorded, "--threads", "1", "--batch", "1")
    assert not any(res["overlapped"] for res in results.values())


def test_json_output_is_data_not_console_markup(home: Path, model_path: Path, recorded: Path, tmp_path: Path):
    # rich turns ":pizza:" into an emoji and "[bold]" into a style: JSON must carry path and message exactly
    odd = tmp_path / "[bold]:pizza:" / "run.json"
    odd.parent.mkdir()
    odd.write_text("{")
    code, results, _ = verify_json(home, model_path, odd)
    assert code == 2
    res = results["run.json"]
    assert res["path"] == str(odd) and res["message"].startswith(f"{odd} is not a JSON record"), res


# ------------------------------------------------------------------------------------------ mismatches


def test_wrong_output_is_a_mismatch_at_the_first_divergent_step(home: Path, model_path: Path, recorded: Path, engine: Engine, tmp_path: Path):
    m = load_manifest(recorded / "greedy.json")
    ids = list(m.output.token_ids)
    ids[3] = 7042  # " Paris" where the model says "\n"
    digests = list(m.output.logits_digests)
    digests[3] = "0" * 64
    write_manifest(with_output(m, token_ids=ids, logits_digests=digests), tmp_path / "wrong.json")
    load_manifest(tmp_path / "wrong.json")  # a well-formed, sealed record: only its outputs are wrong

    r = verify(home, model_path, tmp_path / "wrong.json")
    assert r.exit_code == 1, r.output
    assert re.search(r"│\s*8\s*│\s*mismatch\s*│", row(r.stdout, "wrong.json")), r.stdout
    report = report_lines(r.stdout, "wrong.json")
    assert report[0].endswith(": differs: output.token_ids, output.logits_digests"), report
    text = engine.tokenizer.decode
    divergence = f"  first divergent step 3: expected token 7042 {text([7042])!r}, got {GREEDY_IDS[3]} {text([GREEDY_IDS[3]])!r}"
    assert divergence == "  first divergent step 3: expected token 7042 ' Paris', got 198 '\\n'"
    assert divergence in report, report
    top = [list(x) for x in m.output.top_logits[3]]  # recorded = actual: only the token and digest were edited
    assert len(top) == 5 and top[0][0] == GREEDY_IDS[3]
    assert f"  top-5 expected {top}" in report and f"  top-5 actual   {top}" in report, report


def test_first_divergent_step_is_the_first_differing_digest_or_token(home: Path, model_path: Path, recorded: Path, tmp_path: Path):
    m = load_manifest(recorded / "greedy.json")
    digests = list(m.output.logits_digests)
    digests[5] = "f" * 64
    write_manifest(with_output(m, logits_digests=digests), tmp_path / "digest.json")  # tokens all right
    ids = list(m.output.token_ids)
    ids[2] = 7042
    write_manifest(with_output(m, token_ids=ids, logits_digests=digests), tmp_path / "token_before_digest.json")

    code, results, summary = verify_json(home, model_path, tmp_path)
    assert code == 1 and summary["mismatch"] == 2 and summary["match"] == 0
    digest = results["digest.json"]
    assert [d["field"] for d in digest["differences"]] == ["output.logits_digests"]
    dv = digest["divergence"]
    assert dv["step"] == 5 and dv["expected_token"] == dv["actual_token"] == GREEDY_IDS[5]
    assert dv["expected_top"] == dv["actual_top"] == [list(x) for x in m.output.top_logits[5]]
    both = results["token_before_digest.json"]
    assert [d["field"] for d in both["differences"]] == ["output.token_ids", "output.logits_digests"]
    dv = both["divergence"]
    assert (dv["step"], dv["expected_token"], dv["actual_token"]) == (2, 7042, GREEDY_IDS[2])


def _forge_messages(d: dict) -> None:
    d["prompt"]["messages"] = [{"role": "system", "content": "Always lie."}, *d["prompt"]["messages"]]


def _forge_top(d: dict) -> None:
    d["output"]["top_logits"][0] = [[33, 99.0], [666, 98.0]]


FORGED = {  # a resealed chat record with one field a reader reads changed: (edit, the differing field, or None: a match)
    "messages": (_forge_messages, "prompt.messages (rebuilt from the recorded input)"),
    "rendered": (lambda d: d["prompt"].update(rendered="anything"), "prompt.rendered (rebuilt from the recorded input)"),
    "top_logits": (_forge_top, "output.top_logits"),
    "architecture": (lambda d: d["model"].update(architecture="qwen3"), "model.architecture"),
    "tensor_types": (lambda d: d["model"].update(tensor_types={"F16": 272}), "model.tensor_types"),
    "resealed_only": (lambda d: None, None),  # the control: resealing alone changes nothing
    "file_name": (lambda d: d["model"].update(file_name="Other.gguf"), None),  # where the file was: informative
}


def test_a_resealed_record_that_names_what_was_not_computed_is_a_mismatch(home: Path, model_path: Path, engine: Engine,
                                                                          tmp_path: Path):  # fmt: skip
    """Anyone can reseal a manifest, so every field a reader reads is checked against what its recorded inputs give
    (an independent probe: a system message added to a --chat record, a rendered text, top logits and the model's
    architecture and tensor types all verified as a match once resealed)."""
    chat = execute(engine, build_prompt(engine, text="Name a colour.", chat=True), Sampling(max_tokens=4, ignore_eos=True))
    for name, (edit, _) in FORGED.items():
        data = chat.model_dump(mode="json")
        edit(data)
        write_manifest(RunManifest.model_validate(data), tmp_path / f"{name}.json")  # sealed anew, as anyone can
    code, results, summary = verify_json(home, model_path, tmp_path)
    assert code == 1 and summary["mismatch"] == 5 and summary["match"] == 2, summary
    for name, (_, field) in FORGED.items():
        res = results[f"{name}.json"]
        assert [d["field"] for d in res["differences"]] == ([field] if field else []), (name, res)


# ------------------------------------------------------------------------------------------ bad input


def _tamper_seed(data: dict) -> str:
    data["sampling"]["seed"] += 1  # not re-sealed
    return json.dumps(data)


def _q8_kv(data: dict) -> str:
    data["engine"]["kv_type"] = "q8_0"
    return json.dumps(data)


def _newer_schema(data: dict) -> str:
    data["schema_version"] = SCHEMA_VERSION + 1
    return json.dumps(data)


def _truncated(data: dict) -> str:
    text = json.dumps(data, indent=2)
    return text[: len(text) // 2]


BAD = {  # file name: (break a valid manifest's JSON, words the one-line message must contain)
    "tampered.json": (_tamper_seed, ["section(s) sampling", "edited"]),
    "q8_kv.json": (_q8_kv, ["'q8_0'", KV_QUANT_REASON]),
    "newer.json": (_newer_schema, [f"schema_version {SCHEMA_VERSION + 1}", f"schema {SCHEMA_VERSION}", "upgrade detinfer"]),
    "truncated.json": (_truncated, ["not a JSON record", "truncated"]),
    "notes.json": (lambda data: "# notes\n" + json.dumps(data), ["notes.json is not a JSON record: invalid JSON at line 1 column 1"]),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_manifest_is_bad_input(home: Path, model_path: Path, recorded: Path, tmp_path: Path, name: str):
    breaker, needles = BAD[name]
    (tmp_path / name).write_text(breaker(manifest_data(recorded)))
    code, results, summary = verify_json(home, model_path, tmp_path / name)
    assert code == 2 and summary["bad_input"] == 1 and summary["mismatch"] == 0
    res = results[name]
    assert res["status"] == "bad input" and res["divergence"] is None
    assert "\n" not in res["message"]
    for needle in needles:
        assert needle in res["message"], res["message"]
    assert ("truncated" in res["message"]) == (name == "truncated.json"), res["message"]  # said only where it is


def test_manifest_for_another_model_is_bad_input(home: Path, model_path: Path, recorded: Path, tmp_path: Path):
    # a sealed manifest naming another model's hash: the model is wrong (2), the run is not a mismatch (1)
    m = load_manifest(recorded / "greedy.json")
    write_manifest(m.model_copy(update={"model": m.model.model_copy(update={"sha256": "0" * 64})}), tmp_path / "other.json")
    code, results, summary = verify_json(home, model_path, tmp_path / "other.json")
    assert code == 2 and summary["mismatch"] == 0
    res = results["other.json"]
    assert res["status"] == "bad input" and res["differences"] == []
    for needle in ("model sha256 0000000000000000", model_path.name, m.model.sha256[:16], "--model"):
        assert needle in res["message"], res["message"]


def test_manifest_whose_model_is_missing_is_bad_input(home: Path, model_path: Path, recorded: Path, tmp_path: Path):
    # found by its registry name in $DETINFER_HOME, which is empty here
    r = cli(home, "verify", "--json", recorded / "greedy.json")
    assert r.exit_code == 2, r.output
    res = json.loads(r.stdout.splitlines()[0])
    assert res["status"] == "bad input" and "not downloaded" in res["message"], res
    # two files of a missing model: its one line once, after both names; a file that fails otherwise has its own
    folder = tmp_path / "two"
    folder.mkdir()
    for name in ("a.json", "b.json"):
        shutil.copy(recorded / "greedy.json", folder / name)
    (folder / "c.json").write_text("{")
    r = cli(home, "verify", folder)
    assert r.exit_code == 2, r.output
    said = [line for line in r.stdout.splitlines() if "not downloaded" in line]
    assert "smollm2-135m-instruct-q4_1" in row(r.stdout, "a.json"), r.stdout  # the row names the missing model
    assert len(said) == 1 and said[0].startswith(f"2 files ({folder / 'a.json'}, {folder / 'b.json'}): model "), r.stdout
    assert sum(line.startswith(f"{folder / 'c.json'} is not a JSON record") for line in r.stdout.splitlines()) == 1, r.stdout
    code, results, _ = verify_json(home, tmp_path / "absent.gguf", recorded / "greedy.json")
    assert code == 2 and "does not exist" in results["greedy.json"]["message"]


def test_folder_mixing_good_and_bad_files(home: Path, model_path: Path, recorded: Path, tmp_path: Path):
    shutil.copy(recorded / "greedy.json", tmp_path / "good.json")
    for name, (breaker, _) in BAD.items():
        (tmp_path / name).write_text(breaker(manifest_data(recorded)))
    r = verify(home, model_path, tmp_path)
    assert r.exit_code == 2, r.output
    assert r.stderr == ""  # the reports are on stdout; a progress bar on a pipe left a blank line here
    assert re.search(r"│\s*8\s*│\s*match\s*│", row(r.stdout, "good.json")), r.stdout  # still verified
    for name, (_, needles) in BAD.items():
        assert re.search(r"│\s+│\s*bad input\s*│\s+│", row(r.stdout, name)), r.stdout  # no count or time: it did not run
        report = report_lines(r.stdout, name)
        assert len(report) == 1 and report[0].count(name) == 1, report  # one line per bad file, named once
        for needle in needles:
            assert needle in report[0], report
    assert "good.json:" not in r.stdout and "mismatch" not in r.stdout
    assert re.search(rf"^{len(BAD) + 1} files: 1 match, {len(BAD)} bad input in ", r.stdout, re.M), r.stdout


def test_missing_path_or_empty_folder(home: Path, model_path: Path, recorded: Path, tmp_path: Path):
    r = verify(home, model_path, recorded / "greedy.json", tmp_path / "absent.json")
    assert r.exit_code == 2, r.output
    assert r.stderr.splitlines() == [f"error: {tmp_path / 'absent.json'} does not exist; pass manifest files or folders"]
    assert r.stdout == ""  # refused before anything ran
    (tmp_path / "empty").mkdir()
    r = verify(home, model_path, tmp_path / "empty")
    assert r.exit_code == 2 and r.stderr.splitlines() == [f"error: no manifests found in {tmp_path / 'empty'}"], r.output


# ------------------------------------------------------------------------------------------ golden records


@pytest.fixture(scope="module")
def golden_file(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A golden token stream (the reviewable record in golden/) of an 8-token greedy run at n_ctx 256."""
    case = Case("short_greedy", PROMPT, max_tokens=8, n_ctx=256)
    m = run_case({(256, "f32"): engine}, case).manifest
    path = tmp_path_factory.mktemp("golden") / "short_greedy.json"
    path.write_text(stream_json(run_stream(m)))
    return path


def test_golden_record_verifies(home: Path, model_path: Path, golden_file: Path):
    data = json.loads(golden_file.read_text())
    assert data["output_token_ids"] == GREEDY_IDS and "schema_version" not in data
    code, results, summary = verify_json(home, model_path, golden_file)
    assert code == 0 and summary["match"] == 1
    assert results["short_greedy.json"]["steps"] == 8
    # named as a manifest of the same model is (its registry name), not by the file it ran on
    assert results["short_greedy.json"]["model"] == "smollm2-135m-instruct-q4_1" != model_path.name


def test_golden_record_with_other_tokens_is_a_mismatch(home: Path, model_path: Path, golden_file: Path, tmp_path: Path):
    data = json.loads(golden_file.read_text())
    data["output_token_ids"][2] = 7042
    (tmp_path / "edited.json").write_text(json.dumps(data))
    code, results, _ = verify_json(home, model_path, tmp_path / "edited.json")
    assert code == 1
    res = results["edited.json"]
    assert res["status"] == "mismatch" and [d["field"] for d in res["differences"]] == ["output_token_ids"]
    dv = res["divergence"]
    assert (dv["step"], dv["expected_token"], dv["actual_token"]) == (2, 7042, GREEDY_IDS[2])


def test_a_record_of_other_numerics_is_named_as_such(home: Path, model_path: Path, recorded: Path, golden_file: Path, tmp_path: Path):
    """A file without ``numerics`` was recorded by numerics 1 (glibc expf/logf/sin/cos/pow): verify says so first."""
    data = manifest_data(recorded)
    assert data["numerics"] == NUMERICS and data["informative"]["machine"]["arch"]
    del data["numerics"], data["section_sha256"]["numerics"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    golden = json.loads(golden_file.read_text())
    assert golden.pop("numerics") == NUMERICS
    (tmp_path / "old_golden.json").write_text(json.dumps(golden))
    code, results, _ = verify_json(home, model_path, tmp_path)
    assert code == 1
    for name in ("old.json", "old_golden.json"):
        res = results[name]
        assert res["status"] == "mismatch" and res["differences"][0]["field"] == "numerics", res
        assert res["message"].startswith(f"recorded with numerics 1; this detinfer computes numerics {NUMERICS.rsplit('/', 1)[-1]} ({NUMERICS}); re-record"), res
    assert results["old.json"]["recorded_on"] == results["old.json"]["reexecuted_on"] == machine()


def test_verify_table_shows_where_it_was_recorded_and_re_executed(home: Path, model_path: Path, recorded: Path):
    r = verify(home, model_path, recorded / "greedy.json")
    assert r.exit_code == 0 and "recorded on" in r.stdout and "re-executed on" in r.stdout
    assert describe(machine()) in r.stdout


def test_a_committed_gemma_golden_record_verifies_on_its_own(gemma_path: Path):
    """A golden record names its model by sha256 only; alone (no manifest of that model verified before it, no
    --model) it is re-run on the registry model with that sha256, not on the default model."""
    (result,) = verify_paths([Path(__file__).parent.parent / "golden" / "gemma3_plain_greedy.json"])
    assert result.status == MATCH and result.model == "gemma3-270m-q4_k_m", result  # the registry name of its sha256


def test_differences_show_where_long_values_differ():
    a = list(range(100))
    b = a[:60] + [7] + a[61:]
    ea, eb = excerpts(a, b)
    assert ea != eb and ", 60, " in ea and ", 7, " in eb and ea.startswith("...") and len(ea) <= 86
    assert excerpts("abc", "abd") == ('"abc"', '"abd"')
    assert excerpts(" Paris.\n\nThe", " Lyon.\n\nThe") == ('" Paris.\\n\\nThe"', '" Lyon.\\n\\nThe"')  # one line each


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda s: s.pop("n_ctx"), "settings.n_ctx is missing"),
        (lambda s: s.update(surprise=1), "settings.surprise"),
        (lambda s: s.update(kv_type="q8_0"), KV_QUANT_REASON),
        (lambda s: s.update(chat="yes"), "settings.chat"),
    ],
)
def test_golden_record_with_bad_settings_is_bad_input(home: Path, model_path: Path, golden_file: Path, tmp_path: Path, edit, needle: str):
    data = json.loads(golden_file.read_text())
    edit(data["settings"])
    (tmp_path / "bad.json").write_text(json.dumps(data))
    code, results, _ = verify_json(home, model_path, tmp_path / "bad.json")
    assert code == 2
    assert results["bad.json"]["status"] == "bad input" and needle in results["bad.json"]["message"], results


# ------------------------------------------------------------------------------------------ regeneration


def test_regenerating_manifests_is_a_no_op(model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # all nine cases twice take ~90 s here (long_prompt alone is 1,616 tokens): three cover both KV types,
    # chat + seeded sampling and a stop string
    cases = [c for c in golden.CASES if c.name in ("seeded_sampling", "stop_string", "f16_kv")]
    assert len(cases) == 3
    monkeypatch.setattr(golden, "CASES", tuple(cases))
    model = str(model_path)
    first = write_manifests(tmp_path, model=model)
    assert [(Path(p).name, s) for p, s in first] == [(f"{c.name}.json", "written") for c in cases]
    before = {p: Path(p).read_bytes() for p, _ in first}
    second = write_manifests(tmp_path, model=model)
    assert [s for _, s in second] == ["unchanged"] * 3
    assert {p: Path(p).read_bytes() for p, _ in second} == before  # not rewritten: timings would differ

    # an edited file is rewritten, and only that one
    edited = tmp_path / "stop_string.json"
    data = json.loads(edited.read_text())
    data["output"]["text"] += "!"
    edited.write_text(json.dumps(data))
    third = dict(write_manifests(tmp_path, model=model))
    assert third == {str(tmp_path / f"{c.name}.json"): "written" if c.name == "stop_string" else "unchanged" for c in cases}
    assert load_manifest(edited).contract() == RunManifest.model_validate_json(before[str(edited)]).contract()


# ------------------------------------------------------------------------------------------ determinism matrix


def test_selftest_matrix_in_process(engine: Engine, model_path: Path):
    assert len(engine.tokenizer.encode(STORY)) == 40
    rows = matrix(engine, str(model_path), text=STORY, processes=False)
    results = {r.invariance: r for r in rows}
    assert len(results) == len(rows) == 10
    assert results.pop("batched forward (4 sequences: decode rows, a prefill chunk, a draft window) vs each alone").result == "identical"
    control = results.pop("negative control: reassociated RMSNorm must differ")
    assert control.result == "detected" and control.max_abs_delta is not None and control.max_abs_delta > 0, control
    assert results.pop("KV saved to a .detkv file and restored vs never saved").result == "identical"
    spec = results.pop("speculative decoding (ngram drafts) vs none, sampled")
    assert spec.result == "identical" and re.fullmatch(r"drafts taken [1-9]\d* of \d+", spec.note), spec
    for name in ("prefill chunk 1 vs whole prompt", "prefill chunk 7 vs whole prompt", f"threads 1 vs {numba.config.NUMBA_NUM_THREADS} (same process)"):
        assert name in results
    for r in results.values():
        assert r.result == "identical", r


@pytest.mark.slow
def test_compile_target_generic_vs_host(model_path: Path, gemma_path: Path):
    # cold-compiles every kernel twice, once per fresh numba cache (the two models share each cache): ~2-3 min on
    # 2 shared cores
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as generic_cache, tempfile.TemporaryDirectory() as host_cache:
        for path in (model_path, gemma_path):
            generic = probe_process(str(path), text=STORY, env={"NUMBA_CPU_NAME": "generic", "NUMBA_CPU_FEATURES": "", "NUMBA_CACHE_DIR": generic_cache})
            assert any(Path(generic_cache).rglob("*.nbi")), "the generic probe did not compile into its own cache"
            host = probe_process(str(path), text=STORY, env={"NUMBA_CACHE_DIR": host_cache})
            assert len(generic["generated"]) == 8
            assert generic == host, path.name
    print(f"compile targets: {time.perf_counter() - t0:.0f} s")


# ------------------------------------------------------------------------------------------ read once

_OPENS: list[str] | None = None  # while set, the paths every open() (and os.open) of this process names


def _count_opens(event: str, args: tuple) -> None:
    if _OPENS is not None and event == "open" and isinstance(args[0], (str, bytes, Path)):
        _OPENS.append(str(Path(os.fsdecode(args[0])).resolve()))


def test_verify_reads_each_record_once(model_path: Path, engine: Engine, recorded: Path, golden_file: Path, tmp_path: Path):
    """verify opens each record file once, whatever its kind (manifest, golden stream, session record, session
    snapshot): its kind is decided from the bytes of that one read. The opens are counted by an audit hook (every
    ``open`` and ``os.open`` of the process), so no reader can hide a second read; the control is that the hook sees
    the one read of each file at all."""
    global _OPENS
    from detinfer.compute.sampling import SamplingOverrides
    from detinfer.records.session import ScriptTurn, run_session, write_session
    from detinfer.records.tokenstream import session_stream

    record = run_session(engine, [ScriptTurn(messages=[{"role": "user", "content": "Hi"}])], SamplingOverrides(max_tokens=3))
    write_session(record, tmp_path / "session.json")
    (tmp_path / "session-snapshot.json").write_text(stream_json(session_stream(record)))
    files = [recorded / "greedy.json", golden_file, tmp_path / "session.json", tmp_path / "session-snapshot.json"]
    sys.addaudithook(_count_opens)  # an audit hook cannot be removed: _OPENS switches it off
    _OPENS = []
    try:
        outcomes = verify_paths(files, model=str(model_path))
    finally:
        opens, _OPENS = _OPENS, None
    assert [o.status for o in outcomes] == [MATCH] * 4, [o.message for o in outcomes]
    assert {str(f.resolve()): opens.count(str(f.resolve())) for f in files} == {str(f.resolve()): 1 for f in files}

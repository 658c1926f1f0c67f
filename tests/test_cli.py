"""The ``detinfer`` command end to end: run, re-run a manifest, chat, stop strings, info, models.

In-process with typer's CliRunner and an isolated $DETINFER_HOME (the real model is passed with --model),
plus one subprocess run of ``python -m detinfer.cli``. Bad input is in test_bad_input.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import cli, one_error_line
from gguf_factory import CHATML, write_tiny_gguf

from detinfer.records.manifest import (
    SCHEMA_VERSION,
    load_manifest,
    tokens_sha256,
    write_manifest,
)

REPO = Path(__file__).resolve().parents[1]
PROMPT = "The capital of France is"
PROMPT_IDS = [504, 3575, 282, 4649, 314]  # llama.cpp's tokenization (tests/data/llamacpp)
QUESTION = "What is the capital of France?"



@pytest.fixture(scope="session")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty $DETINFER_HOME: no registry model is visible, GGUF indexes land here."""
    return tmp_path_factory.mktemp("detinfer-home")


def ok(result) -> None:
    assert not (result.exception and not isinstance(result.exception, SystemExit)), repr(result.exception)
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output


@pytest.fixture(scope="module")
def recorded(home: Path, model_path: Path, tmp_path_factory: pytest.TempPathFactory):
    """`detinfer run --prompt PROMPT --max-tokens 8 --out run.json` with the real model: (result, path)."""
    out = tmp_path_factory.mktemp("run") / "run.json"
    r = cli(home, "run", "--model", model_path, "--prompt", PROMPT, "--max-tokens", "8", "--out", out)
    ok(r)
    return r, out


def test_run_writes_manifest(recorded, model_path: Path):
    r, out = recorded
    assert r.stdout.startswith(" Paris")  # stdout is the generated text only
    m = json.loads(out.read_text())
    assert m["schema_version"] == SCHEMA_VERSION
    assert re.fullmatch(r"[0-9a-f]{64}", m["model"]["sha256"])
    assert m["model"]["registry_name"] == "smollm2-135m-instruct-q4_1"
    assert m["prompt"]["token_ids"] == PROMPT_IDS
    assert m["prompt"]["tokens_sha256"] == tokens_sha256(PROMPT_IDS)
    assert len(m["output"]["token_ids"]) == 8
    assert len(m["output"]["logits_digests"]) == 8
    assert m["output"]["stop_reason"] == "max_tokens"
    assert m["output"]["text"].startswith(" Paris")
    assert m["engine"] == {"kv_type": "f32", "n_ctx": 4096}
    assert m["sampling"]["seed"] == 0 and m["sampling"]["temperature"] == 0.0
    assert out.read_text() == json.dumps(m, sort_keys=True, indent=2, ensure_ascii=False) + "\n"  # canonical form
    load_manifest(out)  # sealed: the section hashes check out
    assert "8 tokens, stop: max_tokens" in r.stderr and " tok/s, decode " in r.stderr


def test_rerun_manifest_matches(recorded, model_path: Path, tmp_path: Path):
    _, out = recorded
    # the home that holds the model: the manifest finds it by its registry name, without --model
    r = cli(model_path.parent.parent, "run", "--manifest", out, "--quiet", "--out", tmp_path / "again.json")
    ok(r)
    assert "match" in r.stderr and "mismatch" not in r.stderr
    again = load_manifest(tmp_path / "again.json")
    assert again.contract() == load_manifest(out).contract()


def test_rerun_resealed_wrong_output_exits_1(recorded, home: Path, model_path: Path, tmp_path: Path):
    # a valid, sealed manifest whose recorded tokens are simply wrong: a mismatch (exit 1), not bad input (2)
    _, out = recorded
    m = load_manifest(out)
    ids = [m.output.token_ids[0] + 1, *m.output.token_ids[1:]]
    wrong = m.model_copy(update={"output": m.output.model_copy(update={"token_ids": ids, "tokens_sha256": tokens_sha256(ids)})})
    wrong = wrong.sealed()
    assert wrong.section_sha256["output"] != m.section_sha256["output"]
    write_manifest(wrong, tmp_path / "wrong.json")
    load_manifest(tmp_path / "wrong.json")  # still a well-formed record
    r = cli(home, "run", "--manifest", tmp_path / "wrong.json", "--model", model_path, "--quiet")
    assert r.exit_code == 1, r.output
    assert "Traceback" not in r.output
    assert re.search(r"mismatch output\.token_ids: expected \[7043, .* got \[7042, ", r.stderr), r.stderr
    assert "does not match" in r.stderr.splitlines()[-1]


def test_chat_and_messages_agree(home: Path, model_path: Path, tmp_path: Path):
    r = cli(home, "run", "--model", model_path, "--chat", "--prompt", QUESTION, "--max-tokens", "4", "--out", tmp_path / "chat.json")
    ok(r)
    chat = load_manifest(tmp_path / "chat.json")
    assert chat.prompt.chat and chat.prompt.text == QUESTION
    assert chat.prompt.rendered.endswith("<|im_start|>assistant\n")
    assert chat.prompt.token_ids[0] == 1  # <|im_start|> parsed as the control token, not as text
    assert chat.chat_template_sha256 is not None
    assert "raw text" not in r.stderr and f"{len(chat.prompt.token_ids)} prompt tokens, rendered by the chat template" in r.stderr

    messages = tmp_path / "messages.json"
    messages.write_text(json.dumps([{"role": "user", "content": QUESTION}]))
    r = cli(home, "run", "--model", model_path, "--messages", messages, "--max-tokens", "4", "--out", tmp_path / "msgs.json")
    ok(r)
    msgs = load_manifest(tmp_path / "msgs.json")
    assert msgs.prompt.text is None and [m.model_dump() for m in msgs.prompt.messages] == [{"role": "user", "content": QUESTION}]
    assert msgs.prompt.token_ids == chat.prompt.token_ids
    assert msgs.output.token_ids == chat.output.token_ids
    assert msgs.output.logits_digests == chat.output.logits_digests


def test_stop_string_is_never_emitted(home: Path, model_path: Path, tmp_path: Path):
    # greedy output is " Paris.\n\nThe answer is:"; the stop string spans three tokens ("\n", "\n", "The")
    stop = "\n\nThe"
    r = cli(home, "run", "--model", model_path, "--prompt", PROMPT, "--max-tokens", "8", "--stop", stop, "--stop", "zzz",
            "--out", tmp_path / "stop.json")  # fmt: skip
    ok(r)
    m = load_manifest(tmp_path / "stop.json")
    assert m.output.stop_reason == "stop"
    assert m.output.text == " Paris."
    assert stop not in r.stdout and "The" not in r.stdout
    assert r.stdout == " Paris.\n"
    assert m.sampling.stop == [stop, "zzz"]
    assert f"{len(m.prompt.token_ids)} prompt tokens, raw text (--chat formats it" in r.stderr  # not --chat: the hint
    assert "try --chat" not in r.stderr  # it answered: no second hint


def test_an_empty_answer_to_raw_text_suggests_chat(home: Path, model_path: Path):
    """SmolLM2 ends a bare question at once (EOS first): the run says why its answer is empty and what to try."""
    r = cli(home, "run", "--model", model_path, "--prompt", "What is 2+2?")
    ok(r)
    assert r.stdout == "\n" and "1 token, stop: eos" in r.stderr
    assert "the model ended at once (its first token was EOS), as instruct models often do on raw text: try --chat" in r.stderr
    r = cli(home, "run", "--model", model_path, "--prompt", "What is 2+2?", "--chat", "--max-tokens", "4")
    ok(r)
    assert r.stdout.strip() and "try --chat" not in r.stderr


def test_info_kv_sizes(home: Path, model_path: Path):
    per_position = 30 * 2 * 192 * 4  # n_layer x (K and V) x kv_width x f32 bytes
    assert per_position == 46080
    for ctx in (4096, 8192):
        r = cli(home, "info", model_path, "--ctx", ctx)
        ok(r)
        text = r.stdout
        f32 = re.search(r"f32\s*│\s*([\d,]+)\s*│\s*([\d,]+)", text)
        f16 = re.search(r"f16\s*│\s*([\d,]+)\s*│\s*([\d,]+)", text)
        assert f32 and f16, text
        nums = [int(g.replace(",", "")) for g in (*f32.groups(), *f16.groups())]
        assert nums == [per_position, per_position * ctx, per_position // 2, per_position * ctx // 2]
    assert "377,487,360" in text  # f32 at n_ctx 8192
    assert "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53" in text
    assert "kv_width = n_head_kv × head_dim = 3 × 64 = 192; n_layer = 30" in text


def test_info_default_ctx_is_4096(home: Path, model_path: Path):
    r = cli(home, "info", model_path)
    ok(r)
    assert "188,743,680 (180.0 MiB)" in r.stdout and "94,371,840 (90.0 MiB)" in r.stdout


def test_models_lists_registry(home: Path):
    r = cli(home, "models")
    ok(r)
    assert "smollm2-135m-instruct-q4_1" in r.stdout
    assert re.search(r"smollm2-135m-instruct-q4_1\s*│[^│]*│\s*no\s*│", r.stdout), r.stdout  # the isolated home is empty


def test_help_lists_commands(home: Path):
    r = cli(home, "--help")
    ok(r)
    for command in ("run", "info", "models", "pull"):
        assert command in r.stdout


def _command_paths(command, path=()):
    """Every command and group of the click tree under ``command``, as argument paths (() is the root)."""
    yield path
    for name, sub in getattr(command, "commands", {}).items():
        yield from _command_paths(sub, (*path, name))


def test_every_help_shows_flags_as_flags_and_version_prints(home: Path):
    """-h works everywhere and no on/off option reads as taking a value (``<bool>``); --version and -V print the
    version. Negative control: a plain typer app with a bool option does render ``<bool>``."""
    import typer
    from typer.testing import CliRunner

    from detinfer.cli import app
    from detinfer.version import __version__

    paths = list(_command_paths(typer.main.get_command(app)))
    assert len(paths) > 15 and ("session", "run") in paths and ("kv", "inspect") in paths
    for path in paths:
        r = cli(home, *path, "-h")
        ok(r)
        assert "Show this message and exit." in r.stdout and "<bool>" not in r.stdout, (path, r.stdout)
    for spelling in ("--version", "-V"):
        r = cli(home, spelling)
        ok(r)
        assert r.stdout == f"detinfer {__version__}\n"

    plain = typer.Typer()

    @plain.command()
    def _one(quiet: bool = False) -> None:
        pass

    assert "<bool>" in CliRunner().invoke(plain, ["--help"], env={"COLUMNS": "200"}).stdout


def _panel_rows(help_text: str, panel: str) -> list[str]:
    """The rows of a rich help panel ("Commands"), without its frame."""
    rows = help_text.split(f"─ {panel} ", 1)[1].split("╰", 1)[0].splitlines()[1:]
    return [row.strip("│ ") for row in rows]


def test_every_command_summary_is_one_row_of_its_groups_help():
    """Each command's summary in its group's --help is one row, at a width it fits in: a docstring's source line
    breaks do not cut it mid-sentence. Negative control: a plain typer command of the same docstring shape does."""
    import typer
    from typer.testing import CliRunner

    from detinfer.cli import app

    root = typer.main.get_command(app)
    for path in _command_paths(root):
        group = root
        for name in path:
            group = group.commands[name]
        if getattr(group, "commands", None):
            r = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "250"})
            ok(r)
            rows = _panel_rows(r.stdout, "Commands")
            assert [row.split()[0] for row in rows] == list(group.commands), (path, rows)

    plain = typer.Typer()

    @plain.command()
    def one() -> None:
        """A summary whose sentence goes on
        past its first source line."""

    @plain.command()
    def two() -> None:
        """Another."""

    rows = _panel_rows(CliRunner().invoke(plain, ["--help"], env={"COLUMNS": "250"}).stdout, "Commands")
    assert [row.split()[0] for row in rows] == ["one", "past", "two"], rows


def test_cache_key_of_a_name_and_of_its_file_agree(home: Path, model_path: Path, tmp_path: Path):
    """``detinfer cache-key``: a registry name needs no download (CI computes the key before pulling) and gives the
    key of the same file given by path; another model gives another key; a missing or non-GGUF path is one line."""
    from detinfer.integrations.ci_report import cache_key

    by_name = cli(home, "cache-key", "smollm2-135m-instruct-q4_1")  # the isolated home holds no model
    ok(by_name)
    assert by_name.stdout == cache_key("smollm2-135m-instruct-q4_1") + "\n" == cli(home, "cache-key").stdout
    by_path = cli(home, "cache-key", model_path)
    ok(by_path)
    assert by_path.stdout == by_name.stdout
    assert cli(home, "cache-key", "gemma3-270m-q4_k_m").stdout != by_name.stdout
    one_error_line(cli(home, "cache-key", tmp_path / "absent.gguf"), "does not exist", "registry name")
    (tmp_path / "text.gguf").write_text("not a model")
    one_error_line(cli(home, "cache-key", tmp_path / "text.gguf"), "not a GGUF file")


# ------------------------------------------------------------------------------------------ synthetic model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny")


@pytest.mark.parametrize(
    "matrix_type, tied",
    [("F32", True), ("Q8_0", False), ("Q4_0", True), ("Q4_1", False), ("F16", True)],
)
def test_tiny_model_runs(home: Path, tiny_dir: Path, tmp_path: Path, matrix_type: str, tied: bool):
    model = write_tiny_gguf(tiny_dir / f"tiny-{matrix_type}-{tied}.gguf", matrix_type=matrix_type, tied=tied)
    r = cli(home, "run", "--model", model, "--prompt", "hi", "--max-tokens", "3", "--ignore-eos", "--ctx", "64",
            "--out", tmp_path / "run.json")  # fmt: skip
    ok(r)
    m = load_manifest(tmp_path / "run.json")
    assert len(m.output.token_ids) == 3 and m.output.stop_reason == "max_tokens"
    assert m.model.registry_name is None and m.model.tensor_types[matrix_type] >= 2 * 7
    assert m.chat_template_sha256 is None


def test_tiny_model_reexecutes_with_other_threads_and_chunks(home: Path, tiny_dir: Path, tmp_path: Path):
    model = write_tiny_gguf(tiny_dir / "tiny-chat.gguf", chat_template=CHATML, matrix_type="Q8_0")
    r = cli(home, "run", "--model", model, "--chat", "--prompt", "hi there, the cat", "--max-tokens", "4", "--ignore-eos",
            "--ctx", "64", "--kv-type", "f16", "--chunk-size", "64", "--out", tmp_path / "run.json")  # fmt: skip
    ok(r)
    m = load_manifest(tmp_path / "run.json")
    assert m.engine.kv_type == "f16" and m.prompt.chat and m.prompt.token_ids[0] == 1
    # threads and chunk size are informative: a different split must reproduce every contract field
    r = cli(home, "run", "--manifest", tmp_path / "run.json", "--threads", "1", "--chunk-size", "1", "--quiet")
    ok(r)
    assert "match" in r.stderr


def test_tiny_model_info(home: Path, tiny_dir: Path):
    model = write_tiny_gguf(tiny_dir / "tiny-info.gguf")
    r = cli(home, "info", model, "--ctx", "64")
    ok(r)
    per_position = 2 * 2 * 32 * 4  # n_layer x (K and V) x kv_width (2 heads x 16) x f32 bytes
    assert re.search(rf"f32\s*│\s*{per_position:,}\s*│\s*{per_position * 64:,} \(32\.0 KiB\)", r.stdout), r.stdout


# ------------------------------------------------------------------------------------------ subprocess


def test_subprocess_end_to_end(model_path: Path, tmp_path: Path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "DETINFER_HOME": str(model_path.parent.parent)}
    proc = subprocess.run(
        [sys.executable, "-m", "detinfer.cli", "run", "--model", str(model_path), "--prompt", PROMPT, "--max-tokens", "4",
         "--out", str(tmp_path / "run.json")],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout.startswith(" Paris.")
    assert "4 tokens, stop: max_tokens" in proc.stderr
    assert json.loads((tmp_path / "run.json").read_text())["prompt"]["token_ids"] == PROMPT_IDS


def test_bracketed_names_are_text_not_markup(home: Path, tiny_dir: Path, tmp_path: Path):
    # rich reads "[bold]" as a style and "[/x]" as a closing tag (an exception): names must print as plain text
    model = write_tiny_gguf(tiny_dir / "[bold]x.gguf")
    out = tmp_path / "[" / "x]" / "run.json"  # the path contains "[/x]"
    r = cli(home, "run", "--model", model, "--prompt", "hi", "--max-tokens", "1", "--ctx", "16", "--out", out)
    ok(r)
    assert "[bold]x.gguf: 1 prompt token" in r.stderr and "1 prompt tokens" not in r.stderr and "[/x]/run.json" in r.stderr
    assert "1 token, stop: max_tokens; prefill" in r.stderr and "decode" not in r.stderr  # one token: no decode step
    r = cli(home, "run", "--manifest", out, "--quiet")
    ok(r)
    assert "[/x]/run.json" in r.stderr
    r = cli(home, "info", model)
    ok(r)
    assert "[bold]x.gguf" in r.stdout

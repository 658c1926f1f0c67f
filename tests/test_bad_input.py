"""Bad input at the CLI edge: every case exits 2 with one line naming the problem, no traceback, nothing written.

Broken models are tiny synthetic GGUF files (tests/gguf_factory.py) or cut copies of them; the real model is
only loaded where its own limits matter (context length, prompt length). Runs in-process with typer's
CliRunner and an isolated $DETINFER_HOME.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from cli_helpers import cli, one_error_line
from gguf_factory import TinyConfig, layout, write_tiny_gguf

from detinfer.compute.kvcache import KV_QUANT_REASON, QUANTIZED_KV_TYPES
from detinfer.records.manifest import SCHEMA_VERSION, RunManifest, write_manifest


@pytest.fixture(scope="session")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty $DETINFER_HOME: no registry model is visible, GGUF indexes land here."""
    return tmp_path_factory.mktemp("detinfer-home")




def assert_nothing_written(folder: Path, *names: str) -> None:
    for name in names:
        assert not (folder / name).exists(), f"{name} was written"
    assert not list(folder.glob(".*.tmp")), "a temporary file was left behind"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A valid tiny llama model with no chat template."""
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


def run_model(home: Path, model: Path, out: Path, *extra):
    return cli(home, "run", "--model", model, "--prompt", "hi there", "--max-tokens", "2", "--ctx", "64", "--out", out, *extra)


# ------------------------------------------------------------------------------------------ model files


def test_missing_model_path(home: Path, tmp_path: Path):
    missing = tmp_path / "nope.gguf"
    r = cli(home, "run", "--model", missing, "--prompt", "hi", "--out", tmp_path / "run.json")
    one_error_line(r, str(missing), "does not exist")
    assert_nothing_written(tmp_path, "run.json")
    one_error_line(cli(home, "info", missing), "does not exist")


def test_registry_model_not_downloaded(home: Path, tmp_path: Path):
    r = cli(home, "run", "--prompt", "hi", "--out", tmp_path / "run.json")  # default model, empty home
    one_error_line(r, "not downloaded", "detinfer pull")
    assert_nothing_written(tmp_path, "run.json")


CUTS = {
    "header": lambda lay: 13,  # after magic and version, inside the tensor count
    "metadata": lambda lay: (24 + lay.tensor_infos) // 2,
    "tensor-infos": lambda lay: (lay.tensor_infos + lay.data) // 2,
    "tensor-data": lambda lay: lay.size - 100,
}


@pytest.mark.parametrize("where", CUTS)
def test_truncated_synthetic_model(home: Path, tiny: Path, tmp_path: Path, where: str):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny.read_bytes()[: CUTS[where](layout(tiny))])
    one_error_line(run_model(home, cut, tmp_path / "run.json"), "cut.gguf", "truncated")
    assert_nothing_written(tmp_path, "run.json")


@pytest.mark.parametrize("where", ["metadata", "tensor-data"])
def test_truncated_real_model(home: Path, model_path: Path, tmp_path: Path, where: str):
    cut = tmp_path / "cut.gguf"
    size = model_path.stat().st_size
    n = 1_000_000 if where == "metadata" else size - 4096  # the 49k-token vocabulary spans the first ~2 MB
    with open(model_path, "rb") as src, open(cut, "wb") as dst:
        shutil.copyfileobj(src, dst)
        dst.truncate(n)
    one_error_line(run_model(home, cut, tmp_path / "run.json"), "cut.gguf", "truncated")
    assert_nothing_written(tmp_path, "run.json")


def test_wrong_magic(home: Path, tiny: Path, tmp_path: Path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + tiny.read_bytes()[4:])
    one_error_line(run_model(home, bad, tmp_path / "run.json"), "bad.gguf", "magic", "GGML")
    assert_nothing_written(tmp_path, "run.json")
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    one_error_line(cli(home, "info", empty), "empty.gguf", "magic")


def test_unsupported_architecture(home: Path, tmp_path: Path):
    model = write_tiny_gguf(tmp_path / "mamba.gguf", architecture="mamba")
    one_error_line(run_model(home, model, tmp_path / "run.json"), "'mamba'", "not supported", "llama")
    assert_nothing_written(tmp_path, "run.json")
    one_error_line(cli(home, "info", model), "'mamba'")


@pytest.mark.parametrize(
    "type_name, config",
    [
        ("Q3_K", TinyConfig(n_embd=256, n_head=4, n_head_kv=2, n_ff=256)),  # K-quants need rows of 256
        ("IQ2_XS", TinyConfig(n_embd=256, n_head=4, n_head_kv=2, n_ff=256)),
        ("IQ4_NL", TinyConfig()),
    ],
)
def test_unsupported_tensor_type(home: Path, tmp_path: Path, type_name: str, config: TinyConfig):
    model = write_tiny_gguf(tmp_path / "q.gguf", config=config, types={"blk.1.ffn_up.weight": type_name})
    one_error_line(run_model(home, model, tmp_path / "run.json"), "'blk.1.ffn_up.weight'", type_name, "not support")
    assert_nothing_written(tmp_path, "run.json")


def test_missing_tensor(home: Path, tmp_path: Path):
    model = write_tiny_gguf(tmp_path / "m.gguf", drop_tensors=("blk.1.attn_v.weight",))
    one_error_line(run_model(home, model, tmp_path / "run.json"), "'blk.1.attn_v.weight'", "missing")
    assert_nothing_written(tmp_path, "run.json")


def test_wrong_tensor_shape(home: Path, tmp_path: Path):
    model = write_tiny_gguf(tmp_path / "s.gguf", shapes={"blk.0.attn_k.weight": (64, 64)})  # kv width is 32
    one_error_line(run_model(home, model, tmp_path / "run.json"), "'blk.0.attn_k.weight'", "(64, 64)", "(32, 64)")
    assert_nothing_written(tmp_path, "run.json")


def test_missing_config_key(home: Path, tmp_path: Path):
    model = write_tiny_gguf(tmp_path / "k.gguf", drop_metadata=("llama.block_count",))
    one_error_line(run_model(home, model, tmp_path / "run.json"), "'llama.block_count'", "missing")
    assert_nothing_written(tmp_path, "run.json")


# ------------------------------------------------------------------------------------------ prompts


def test_empty_prompt(home: Path, tiny: Path, tiny_chat: Path, tmp_path: Path):
    r = cli(home, "run", "--model", tiny, "--prompt", "", "--out", tmp_path / "run.json", "--ctx", "64")
    one_error_line(r, "--prompt is empty; give the text to continue")
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    r = cli(home, "run", "--model", tiny, "--prompt-file", empty, "--out", tmp_path / "run.json", "--ctx", "64")
    one_error_line(r, f"--prompt-file {empty} is empty")
    for chat in (["--chat"], ["--chat", "--system", "be brief"]):  # an empty message is a mistake too ("$PROMPT" unset)
        r = cli(home, "run", "--model", tiny_chat, *chat, "--prompt", "", "--out", tmp_path / "run.json", "--ctx", "64")
        one_error_line(r, "--prompt is empty; give the message to send")
    assert_nothing_written(tmp_path, "run.json")


def test_no_prompt_or_two_prompts(home: Path, tiny: Path, tmp_path: Path):
    one_error_line(cli(home, "run", "--model", tiny), "exactly one of --prompt")
    f = tmp_path / "p.txt"
    f.write_text("hi")
    one_error_line(cli(home, "run", "--model", tiny, "--prompt", "hi", "--prompt-file", f), "exactly one of --prompt")


def test_prompt_longer_than_ctx(home: Path, model_path: Path, tmp_path: Path):
    prompt = "The quick brown fox jumps over the lazy dog and keeps on running"
    r = cli(home, "run", "--model", model_path, "--prompt", prompt, "--ctx", "8", "--out", tmp_path / "run.json")
    one_error_line(r, "prompt has", "context holds 8", "--ctx")
    assert_nothing_written(tmp_path, "run.json")


def test_ctx_above_model_context(home: Path, model_path: Path, tmp_path: Path):
    r = cli(home, "run", "--model", model_path, "--prompt", "hi", "--ctx", "8193", "--out", tmp_path / "run.json")
    one_error_line(r, "--ctx 8193", "8192")
    assert_nothing_written(tmp_path, "run.json")
    one_error_line(cli(home, "run", "--model", model_path, "--prompt", "hi", "--ctx", "0"), "--ctx 0")


def test_ctx_beyond_available_memory(home: Path, tmp_path: Path):
    """A context whose KV cache cannot fit in memory fails before anything is allocated, naming size and fix."""
    from detinfer.compute.kvcache import available_memory

    n_ctx = 1 << 31  # tiny model: 2 layers x 2 x kv_width 32 x 4 bytes = 512 bytes per position -> 1 TiB
    assert available_memory() < 512 * n_ctx
    model = write_tiny_gguf(tmp_path / "long.gguf", config=TinyConfig(n_ctx_train=n_ctx))
    r = cli(home, "run", "--model", model, "--prompt", "hi", "--ctx", str(n_ctx), "--out", tmp_path / "run.json")
    one_error_line(r, "1024.00 GiB", "2 layers x 2147483648 positions x 2 x 32 x 4 bytes", "lower --ctx or use --kv-type f16")
    assert_nothing_written(tmp_path, "run.json")


@pytest.mark.parametrize(
    "option, value",
    [("--temperature", "-1"), ("--top-p", "0"), ("--top-p", "1.5"), ("--top-k", "-1"), ("--repeat-penalty", "0"),
     ("--min-p", "1"), ("--temperature", "nan")],
)
def test_invalid_sampling_values(home: Path, model_path: Path, tmp_path: Path, option: str, value: str):
    r = cli(home, "run", "--model", model_path, "--prompt", "hi", option, value, "--out", tmp_path / "run.json")
    one_error_line(r, f"{option} {value}", "must be")  # the flag as typed (not the field's name)
    assert_nothing_written(tmp_path, "run.json")


def test_invalid_max_tokens_and_threads(home: Path, model_path: Path, tmp_path: Path):
    r = cli(home, "run", "--model", model_path, "--prompt", "hi", "--max-tokens", "0", "--out", tmp_path / "run.json")
    one_error_line(r, "--max-tokens 0: must be greater than or equal to 1")
    # chat checks its sampling flags before it loads a model (this one does not exist)
    r = cli(home, "chat", "--model", tmp_path / "absent.gguf", "--max-tokens", "0")
    one_error_line(r, "--max-tokens 0: must be greater than or equal to 1")
    r = cli(home, "run", "--model", model_path, "--prompt", "hi", "--threads", "0", "--out", tmp_path / "run.json")
    one_error_line(r, "--threads 0")
    assert_nothing_written(tmp_path, "run.json")


@pytest.mark.parametrize("kv_type", QUANTIZED_KV_TYPES)
def test_quantized_kv_type_rejected_before_loading(home: Path, tmp_path: Path, kv_type: str):
    # the model path does not exist: the error must still be about the KV type, so it was checked first
    r = cli(home, "run", "--model", tmp_path / "absent.gguf", "--prompt", "hi", "--kv-type", kv_type, "--out", tmp_path / "run.json")
    one_error_line(r, repr(kv_type), KV_QUANT_REASON)
    assert_nothing_written(tmp_path, "run.json")


def test_unknown_kv_type(home: Path, tmp_path: Path):
    r = cli(home, "run", "--model", tmp_path / "absent.gguf", "--prompt", "hi", "--kv-type", "f64")
    one_error_line(r, "'f64'", "f32 or f16")


def test_prompt_file_invalid_utf8(home: Path, tmp_path: Path):
    f = tmp_path / "prompt.txt"
    f.write_bytes("héllo ".encode() + b"\xff\xfe world")
    r = cli(home, "run", "--model", tmp_path / "absent.gguf", "--prompt-file", f, "--out", tmp_path / "run.json")
    one_error_line(r, "prompt.txt", "UTF-8", "0xff", "offset 7")
    assert_nothing_written(tmp_path, "run.json")


def test_prompt_file_missing(home: Path, tmp_path: Path):
    r = cli(home, "run", "--model", tmp_path / "absent.gguf", "--prompt-file", tmp_path / "[/none].txt")
    one_error_line(r, "cannot read prompt file", "[/none].txt")  # brackets are text, not console markup


def test_chat_without_template(home: Path, tiny: Path, tmp_path: Path):
    r = cli(home, "run", "--model", tiny, "--prompt", "hi", "--chat", "--ctx", "64", "--out", tmp_path / "run.json")
    one_error_line(r, "tiny.gguf", "no chat template")
    msgs = tmp_path / "m.json"
    msgs.write_text(json.dumps([{"role": "user", "content": "hi"}]))
    r = cli(home, "run", "--model", tiny, "--messages", msgs, "--ctx", "64", "--out", tmp_path / "run.json")
    one_error_line(r, "no chat template")
    assert_nothing_written(tmp_path, "run.json")


@pytest.mark.parametrize(
    "content, needle",
    [
        ({"role": "user", "content": "hi"}, "expected a list"),
        ([{"content": "hi"}], "message 0 has no 'role'"),
        ([{"role": "user", "content": "hi"}, {"role": "user"}], "message 1 has no 'content'"),
        ([{"role": "user", "content": 3}], "'content' that is a number"),
        ([], "empty"),
        ("[{", "invalid JSON at column 3 (Expecting property name enclosed in double quotes); it may be truncated"),
        ('[{"role": \n', "invalid JSON at line 2 column 1 (Expecting value); it may be truncated"),  # not "column 1" alone
    ],
)
def test_bad_messages_file(home: Path, tmp_path: Path, content, needle: str):
    f = tmp_path / "messages.json"
    f.write_text(content if isinstance(content, str) else json.dumps(content))
    r = cli(home, "run", "--model", tmp_path / "absent.gguf", "--messages", f, "--out", tmp_path / "run.json")
    one_error_line(r, "messages.json", needle)
    assert_nothing_written(tmp_path, "run.json")


# ------------------------------------------------------------------------------------------ manifests




@pytest.fixture(scope="module")
def manifest_json(home: Path, tiny_chat: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A valid manifest recorded from the tiny model, as JSON data to break in each test."""
    out = tmp_path_factory.mktemp("manifest") / "run.json"
    r = cli(home, "run", "--model", tiny_chat, "--chat", "--prompt", "hi there", "--max-tokens", "3", "--ignore-eos",
            "--ctx", "64", "--out", out)  # fmt: skip
    assert r.exit_code == 0, r.output
    return json.loads(out.read_text())


def rerun(home: Path, manifest: Path, tmp_path: Path, *extra):
    return cli(home, "run", "--manifest", manifest, "--out", tmp_path / "again.json", *extra)


def write_json(path: Path, data) -> Path:
    path.write_text(json.dumps(data))
    return path


def test_recorded_manifest_reexecutes(home: Path, manifest_json: dict, tmp_path: Path):
    r = rerun(home, write_json(tmp_path / "run.json", manifest_json), tmp_path)
    assert r.exit_code == 0, r.output
    assert "match" in r.stderr


def test_manifest_unreadable(home: Path, tmp_path: Path):
    one_error_line(rerun(home, tmp_path / "absent.json", tmp_path), "cannot read manifest", "absent.json")
    folder = tmp_path / "folder.json"
    folder.mkdir()
    one_error_line(rerun(home, folder, tmp_path), "cannot read manifest", "folder.json")
    assert_nothing_written(tmp_path, "again.json")


def test_manifest_not_json(home: Path, manifest_json: dict, tmp_path: Path):
    text = json.dumps(manifest_json, indent=2)
    cases = {"garbage.json": "not json at all", "cut.json": text[: len(text) // 2], "list.json": "[1, 2]"}
    for name, content in cases.items():
        (tmp_path / name).write_text(content)
        one_error_line(rerun(home, tmp_path / name, tmp_path), name, "manifest")
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe{}")
    one_error_line(rerun(home, tmp_path / "binary.json", tmp_path), "not a JSON manifest")
    assert_nothing_written(tmp_path, "again.json")


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda m: m["sampling"].pop("seed"), "sampling.seed"),
        (lambda m: m["engine"].update(kv_type="q8_0"), "engine.kv_type"),
        (lambda m: m["output"].update(token_ids="1,2,3"), "output.token_ids"),
        (lambda m: m.update(surprise=1), "surprise"),
    ],
)
def test_manifest_schema_invalid(home: Path, manifest_json: dict, tmp_path: Path, edit, needle: str):
    data = json.loads(json.dumps(manifest_json))
    edit(data)
    one_error_line(rerun(home, write_json(tmp_path / "run.json", data), tmp_path), "not a valid manifest", needle)
    assert_nothing_written(tmp_path, "again.json")


@pytest.mark.parametrize("version", [SCHEMA_VERSION + 1, 99])
def test_manifest_newer_schema_version(home: Path, manifest_json: dict, tmp_path: Path, version: int):
    data = {**manifest_json, "schema_version": version}
    line = one_error_line(rerun(home, write_json(tmp_path / "run.json", data), tmp_path), "upgrade detinfer")
    assert f"schema_version {version}" in line and f"schema {SCHEMA_VERSION}" in line
    assert_nothing_written(tmp_path, "again.json")


@pytest.mark.parametrize(
    "edit, section",
    [
        (lambda m: m["output"]["token_ids"].__setitem__(0, m["output"]["token_ids"][0] + 1), "output"),
        (lambda m: m["sampling"].update(seed=m["sampling"]["seed"] + 1), "sampling"),
        (lambda m: m["prompt"]["token_ids"].append(5), "prompt"),
        (lambda m: m["output"].update(text=m["output"]["text"] + "!"), "output"),
        (lambda m: m["engine"].update(n_ctx=32), "engine"),
    ],
)
def test_manifest_tampered(home: Path, manifest_json: dict, tmp_path: Path, edit, section: str):
    data = json.loads(json.dumps(manifest_json))
    edit(data)
    line = one_error_line(rerun(home, write_json(tmp_path / "run.json", data), tmp_path), "edited")
    assert f"{section}." in line or f"section(s) {section}" in line
    assert_nothing_written(tmp_path, "again.json")


def test_manifest_model_sha256_mismatch(home: Path, manifest_json: dict, tmp_path: Path):
    # a sealed (valid) manifest that names another model's hash: a wrong input, exit 2, not a mismatch (1)
    m = RunManifest.model_validate(manifest_json)
    other = m.model_copy(update={"model": m.model.model_copy(update={"sha256": "0" * 64})})
    write_manifest(other, tmp_path / "run.json")
    line = one_error_line(rerun(home, tmp_path / "run.json", tmp_path), "sha256", "--model")
    assert "0000000000000000" in line
    assert_nothing_written(tmp_path, "again.json")


def test_manifest_with_another_model_file(home: Path, manifest_json: dict, tiny: Path, tmp_path: Path):
    r = rerun(home, write_json(tmp_path / "run.json", manifest_json), tmp_path, "--model", tiny)
    one_error_line(r, "sha256", "tiny.gguf")
    assert_nothing_written(tmp_path, "again.json")


def test_manifest_with_prompt_option(home: Path, manifest_json: dict, tmp_path: Path):
    r = rerun(home, write_json(tmp_path / "run.json", manifest_json), tmp_path, "--prompt", "hi")
    one_error_line(r, "--manifest", "--prompt")


def test_json_of_the_wrong_kind_says_what_it_is(home: Path, tiny_chat: Path, tmp_path: Path):
    """A top level that is not an object, or a session script where a record goes, is named for what it is (not a
    location-less "Input should be a valid dictionary", nor "not a valid session snapshot: model_sha256: Field required")."""
    (tmp_path / "list.json").write_text("[1, 2]")
    one_error_line(cli(home, "session", "run", tmp_path / "list.json"), "list.json: the top level must be a JSON object, got an array")
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"sampling": {"max_tokens": 3}, "turns": [{"messages": [{"role": "user", "content": "Hi"}]}]}))
    for command in ("replay", "verify"):
        r = cli(home, command, script)
        assert r.exit_code == 2 and "Traceback" not in r.output, r.output
        assert f"{script} is a session script (turns to run), not a record of a run: run it with `detinfer session run" in r.stdout, r.stdout
    (tmp_path / "blank.json").write_text("")
    (tmp_path / "cut.json").write_text('{"schema_version": 3, "prompt": {"text": "The capi')
    for name, said in (("blank.json", "blank.json is not a JSON manifest: it is empty"),
                       ("cut.json", "cut.json is not a JSON manifest: invalid JSON at column 42 (Unterminated string); it may be truncated")):
        one_error_line(cli(home, "run", "--manifest", tmp_path / name), said)
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"schema_version": SCHEMA_VERSION, "prompt": {}}, indent=2))  # one document, many lines
    one_error_line(cli(home, "session", "run", manifest), "manifest.json is a run manifest, not a session script")
    one_error_line(cli(home, "batch", manifest, "--out-dir", tmp_path / "out"), "is one JSON document over several lines, not JSONL")
    assert not (tmp_path / "out").exists()
    lines = ['{"id": "../x", "prompt": "hi"}', '{"id": "a", "prompt": "hi", "messages": []}', '{"id": "b", "prompt": ""}']
    (tmp_path / "three.jsonl").write_text("".join(line + "\n" for line in lines))
    r = cli(home, "batch", tmp_path / "three.jsonl", "--out-dir", tmp_path / "out", "--model", tiny_chat, "--threads", "1")
    at = f"{tmp_path / 'three.jsonl'}:"
    # plain words, not the id's regex, pydantic's "Value error, " or run's --prompt advice
    assert [line for line in r.stdout.splitlines() if line.startswith(at)] == [
        f"{at}1: id: \"../x\" cannot name a file: use 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit",
        f"{at}2: give exactly one of prompt, messages", f"{at}3: b: the prompt is empty; a raw completion needs some text to continue"], r.stdout
    (tmp_path / "bad.jsonl").write_text("[1]\n")
    r = cli(home, "batch", tmp_path / "bad.jsonl", "--out-dir", tmp_path / "out")
    assert r.exit_code == 2 and "0 written, 0 skipped (--resume), 1 bad input" in r.stdout and "manifests in" not in r.stdout, r.stdout
    # the line is named once, compiler-style; nothing ran, so no tokens or rate are shown for it
    assert f"{tmp_path / 'bad.jsonl'}:1: the top level must be a JSON object, got an array" in r.stdout.splitlines(), r.stdout
    assert r.stderr.splitlines() == ["[1/1] line-1: bad input", "ran 1/1 in this process in 0.0 s: 1 bad input"], r.stderr
    snapshot = tmp_path / "turn-001.detkv"
    snapshot.write_bytes(b"DETKV\0\0\0" + bytes(range(200)))  # binary: not JSON, and said to be a snapshot
    r = cli(home, "verify", snapshot)
    assert r.exit_code == 2 and "is a KV cache snapshot (.detkv), not a record: inspect it with detinfer kv inspect" in r.stdout, r.stdout
    (tmp_path / "zero.detkv").write_bytes(b"")
    one_error_line(cli(home, "kv", "inspect", tmp_path / "zero.detkv"), "zero.detkv: empty (0 bytes), not a .detkv KV snapshot")
    (tmp_path / "empty.json").write_text("{}")
    one_error_line(cli(home, "run", "--manifest", tmp_path / "empty.json"), "empty.json is not a manifest: it has none of the keys of a run manifest")
    # control: the same turns with a record's schema_version are read as a record (and fail as one, not as a script)
    script.write_text(json.dumps({"schema_version": SCHEMA_VERSION, "turns": [{"messages": []}]}))
    r = cli(home, "replay", script)
    assert r.exit_code == 2 and "session script" not in r.stdout and "not a valid session record" in r.stdout, r.stdout

"""Chat templates in the jinja2 sandbox: the model's template against llama.cpp's rendered prompt, and failures."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import gguf
import pytest
from cli_helpers import cli
from gguf_factory import write_tiny_gguf

from detinfer.errors import DetinferError, InputError, ManifestError, TemplateError
from detinfer.model.chat import (
    BUILTIN_TEMPLATES,
    ChatTemplate,
    load_messages,
    validate_messages,
)
from detinfer.model.gguf_file import ModelFile
from detinfer.model.registry import ensure_model
from detinfer.model.tokenizer import Tokenizer
from detinfer.records.manifest import SCHEMA_VERSION, load_manifest
from detinfer.records.session import SESSION_SCHEMA_VERSION

USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def model_file(model_path: Path) -> ModelFile:
    return ModelFile(model_path)


@pytest.fixture(scope="module")
def template(model_file: ModelFile) -> ChatTemplate:
    t = ChatTemplate.from_model(model_file)
    assert t is not None
    return t


def reference_chat(reference: dict) -> dict:
    return next(p for p in reference["prompts"] if p["name"] == "chat")


def test_model_template_renders_llamacpp_prompt(template: ChatTemplate, smollm2_reference: dict):
    messages = [{"role": "user", "content": smollm2_reference["chat_user_message"]}]
    assert template.render(messages) == reference_chat(smollm2_reference)["text"]


def test_rendered_prompt_tokenizes_to_llamacpp_ids(
    template: ChatTemplate, model_file: ModelFile, smollm2_reference: dict
):
    tok = Tokenizer.from_model(model_file)
    messages = [{"role": "user", "content": smollm2_reference["chat_user_message"]}]
    ids = tok.encode(template.render(messages), parse_special=True)
    assert ids == reference_chat(smollm2_reference)["tokens"]


def test_hash_is_sha256_of_source(template: ChatTemplate, model_file: ModelFile):
    assert template.source == model_file.get("tokenizer.chat_template")
    assert template.hash == hashlib.sha256(template.source.encode()).hexdigest()


def test_generation_prompt_and_system_message(template: ChatTemplate):
    with_prompt = template.render(USER)
    without = template.render(USER, add_generation_prompt=False)
    assert with_prompt == without + "<|im_start|>assistant\n"
    system = template.render([{"role": "system", "content": "Be brief."}, *USER], add_generation_prompt=False)
    assert system == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"


def test_from_model_without_template_is_none(tmp_path: Path):
    w = gguf.GGUFWriter(tmp_path / "t.gguf", "llama")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert ChatTemplate.from_model(ModelFile(tmp_path / "t.gguf", use_index=False)) is None


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ ''.__class__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ cycler.__init__.__globals__ }}",
        "{{ messages.__class__ }}",
        "{% set _ = messages.append(1) %}",
        "{% set _ = messages[0].update(role='system') %}",
    ],
)
def test_sandbox_blocks_escapes_and_mutation(source: str):
    with pytest.raises(TemplateError, match="SecurityError"):
        ChatTemplate(source).render(USER)


def test_raise_exception_becomes_template_error():
    t = ChatTemplate(
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('System message required') }}{% endif %}"
    )
    with pytest.raises(TemplateError, match="System message required"):
        t.render(USER)


@pytest.mark.parametrize(
    ("source", "match"),
    [
        ("{{ foo.bar }}", "UndefinedError"),
        ("{{ 1 / 0 }}", "ZeroDivisionError"),
        ("{{ messages[0]['content'] + 1 }}", "TypeError"),
    ],
)
def test_render_errors_are_one_line_template_errors(source: str, match: str):
    with pytest.raises(TemplateError, match=match) as e:
        ChatTemplate(source).render(USER)
    assert "\n" not in str(e.value)


def test_syntax_error_is_reported_at_compile():
    with pytest.raises(TemplateError, match="does not compile: line 2") as e:
        ChatTemplate("ok\n{% for m in messages %}{{ m }")
    assert "\n" not in str(e.value)


def test_environment_matches_hf_transformers():
    # trim_blocks + lstrip_blocks: block tags leave no blank lines or indentation behind
    t = ChatTemplate(
        "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}"
    )
    assert t.render(USER * 2) == "[Hi]\n[Hi]\n"
    # loopcontrols
    assert ChatTemplate("{% for m in messages %}{{ loop.index }}{% break %}{% endfor %}").render(USER * 3) == "1"
    # tojson does not HTML-escape, like transformers' filter
    assert ChatTemplate("{{ messages[0] | tojson }}").render([{"role": "user", "content": "<b>é&"}]) == (
        '{"role": "user", "content": "<b>é&"}'
    )
    # special tokens and tools are passed through
    specials = ChatTemplate("{{ bos_token }}|{{ eos_token }}|{{ tools is none }}")
    assert specials.render(USER, bos_token="<s>", eos_token="</s>") == "<s>|</s>|True"
    assert ChatTemplate("{{ tools[0].name }}").render(USER, tools=[{"name": "search"}]) == "search"


def test_no_clock_in_templates():
    assert ChatTemplate("{{ strftime_now is defined }}").render(USER) == "False"


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ({"role": "user", "content": "hi"}, "expected a list"),
        ([], "empty"),
        ([{"role": "user", "content": "a"}, "b"], "message 1 is a str"),
        ([{"content": "a"}], "message 0 has no 'role'"),
        ([{"role": "user"}], "message 0 has no 'content'"),
        ([USER[0], {"role": "user", "content": None}], "message 1 has a 'content' that is null"),
        ([{"role": 3, "content": "a"}], "message 0 has a 'role' that is a number"),
    ],
)
def test_bad_messages_raise_input_error(template: ChatTemplate, messages, match: str):
    with pytest.raises(InputError, match=match):
        template.render(messages)
    assert issubclass(InputError, DetinferError)


def test_load_messages(tmp_path: Path):
    path = tmp_path / "m.json"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🦙"}]
    path.write_text(json.dumps(messages), encoding="utf-8")
    assert load_messages(path) == messages
    assert validate_messages(messages) is messages


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (None, "not found"),
        ("[{\"role\": \"user\", \"content\": \"hi\"}", "invalid JSON at column"),
        ("{\"role\": \"user\", \"content\": \"hi\"}", "expected a list"),
        ("[{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"user\"}]", "message 1 has no 'content'"),
        (b"\xff\xfe[]", "not a JSON messages file"),
    ],
)
def test_load_messages_errors_name_file_and_problem(tmp_path: Path, content, match: str):
    path = tmp_path / "bad.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content, encoding="utf-8")
    with pytest.raises(InputError, match=match) as e:
        load_messages(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


# --- --chat-template: built-in formats (llama.cpp's) and jinja files, for models without a template


@pytest.fixture(scope="module")
def gemma_tok() -> Tokenizer:
    return Tokenizer.from_model(ModelFile(ensure_model("gemma3-270m-q4_k_m")))


def test_builtin_gemma_renders_and_tokenizes_like_llamacpp(gemma_tok: Tokenizer, gemma3_reference: dict):
    # The gemma file has no template; llama.cpp formatted the reference chat prompt with its built-in "gemma"
    chat = reference_chat(gemma3_reference)
    question = "What are three good habits for staying healthy? Answer in two sentences."
    t = ChatTemplate.builtin("gemma")
    rendered = t.render([{"role": "user", "content": question}], bos_token="<bos>", eos_token="<eos>")
    assert rendered == chat["text"]
    assert t.add_bos is None  # built-ins leave BOS to the tokenizer, as llama.cpp does
    assert gemma_tok.encode(rendered, add_bos=t.add_bos, parse_special=True) == chat["tokens"]


def test_builtin_gemma_merges_system_into_first_user_turn():
    messages = [
        {"role": "system", "content": " Be brief.\n"},
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "\u00a0hi\t"},  # only ASCII whitespace is trimmed (C isspace)
        {"role": "assistant", "content": "yo "},
        {"role": "user", "content": "x"},
    ]
    assert ChatTemplate.builtin("gemma").render(messages, add_generation_prompt=False) == (
        "<start_of_turn>user\nBe brief.Be kind.\n\n\u00a0hi<end_of_turn>\n"
        "<start_of_turn>model\nyo<end_of_turn>\n<start_of_turn>user\nx<end_of_turn>\n"
    )


def test_builtin_chatml():
    t = ChatTemplate.builtin("chatml")
    assert t.render(USER) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert (t.origin, t.name) == ("builtin", "chatml")


def test_template_option_resolves_builtin_then_file(tmp_path: Path):
    assert ChatTemplate.from_option("gemma").origin == "builtin"
    f = tmp_path / "mine.jinja"
    f.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}", encoding="utf-8")
    t = ChatTemplate.from_option(str(f))
    assert (t.origin, t.name, t.add_bos) == ("file", "mine.jinja", False)
    assert t.render(USER) == "[Hi]"
    with pytest.raises(InputError, match=r"'nope\.jinja' is neither a file nor a built-in format \(gemma, chatml, chatml-tools\)"):
        ChatTemplate.from_option("nope.jinja")
    with pytest.raises(TemplateError, match="no built-in chat format 'llama9'; built-in formats: gemma, chatml, chatml-tools"):
        ChatTemplate.builtin("llama9")
    assert set(BUILTIN_TEMPLATES) == {"gemma", "chatml", "chatml-tools"}


@pytest.fixture(scope="module")
def plain_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model (ChatML special tokens, BOS id 1, add_bos false) whose file has no chat template."""
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny-plain") / "tiny-plain.gguf")


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("detinfer-home")


def run_chat(home: Path, model: Path, out: Path, *extra):
    return cli(home, "run", "--model", model, "--chat", "--prompt", "hi there, the cat", "--max-tokens", "3",
               "--ignore-eos", "--ctx", "64", "--out", out, "--quiet", *extra)  # fmt: skip


def test_chat_without_template_names_the_fix(home: Path, plain_model: Path, tmp_path: Path):
    r = run_chat(home, plain_model, tmp_path / "run.json")
    assert r.exit_code == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "has no chat template; pass --chat-template" in lines[0] and "gemma, chatml" in lines[0]
    r = cli(home, "run", "--model", plain_model, "--prompt", "hi", "--chat-template", "chatml")
    assert r.exit_code == 2 and "--chat-template formats a chat prompt; add --chat" in r.stderr


def test_builtin_template_is_recorded_and_reexecuted(home: Path, plain_model: Path, tmp_path: Path):
    out = tmp_path / "run.json"
    r = run_chat(home, plain_model, out, "--chat-template", "chatml")
    assert r.exit_code == 0, r.output
    m = load_manifest(out)
    assert m.schema_version == SCHEMA_VERSION == 3
    builtin = ChatTemplate.builtin("chatml")
    assert m.chat_template is not None
    assert (m.chat_template.origin, m.chat_template.name, m.chat_template.source) == ("builtin", "chatml", builtin.source)
    assert m.chat_template_sha256 == m.chat_template.sha256 == builtin.hash
    assert m.prompt.rendered == "<|im_start|>user\nhi there, the cat<|im_end|>\n<|im_start|>assistant\n"
    assert m.prompt.token_ids[0] == 1  # <|im_start|>, parsed; no BOS prepended (the model's add_bos is false)
    assert "chat_template" in m.section_sha256
    r = cli(home, "run", "--manifest", out, "--quiet")
    assert r.exit_code == 0 and "match" in r.stderr, r.output
    r = cli(home, "verify", out, "--json")
    assert r.exit_code == 0, r.output
    r = cli(home, "run", "--manifest", out, "--chat-template", "gemma")
    assert r.exit_code == 2 and "drop --chat-template" in r.stderr


def test_template_file_is_recorded_and_reexecuted_without_the_file(home: Path, plain_model: Path, tmp_path: Path):
    f = tmp_path / "mine.jinja"
    f.write_text("{% for m in messages %}<|im_start|>{{ m['role'] }}: {{ m['content'] }}<|im_end|>{% endfor %}"
                 "<|im_start|>", encoding="utf-8")  # fmt: skip
    out = tmp_path / "run.json"
    assert run_chat(home, plain_model, out, "--chat-template", f).exit_code == 0
    m = load_manifest(out)
    assert m.chat_template is not None and (m.chat_template.origin, m.chat_template.name) == ("file", "mine.jinja")
    assert m.prompt.rendered == "<|im_start|>user: hi there, the cat<|im_end|><|im_start|>"
    f.unlink()  # the manifest holds the text: re-execution does not need the file
    r = cli(home, "run", "--manifest", out, "--quiet")
    assert r.exit_code == 0 and "match" in r.stderr, r.output


def test_edited_recorded_template_is_caught(home: Path, plain_model: Path, tmp_path: Path):
    out = tmp_path / "run.json"
    assert run_chat(home, plain_model, out, "--chat-template", "chatml").exit_code == 0
    data = json.loads(out.read_text())
    data["chat_template"]["source"] = data["chat_template"]["source"].replace("assistant", "bot")
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(data))
    with pytest.raises(ManifestError, match="section\\(s\\) chat_template no longer match"):
        load_manifest(edited)
    del data["chat_template"]  # dropping the record is caught too: its section hash is still listed
    edited.write_text(json.dumps(data))
    with pytest.raises(ManifestError, match="chat_template no longer match"):
        load_manifest(edited)


def test_sessions_record_and_replay_a_chat_template(home: Path, plain_model: Path, tmp_path: Path):
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"sampling": {"max_tokens": 3}, "turns": [
        {"messages": [{"role": "user", "content": "hi there"}]},
        {"messages": [{"role": "user", "content": "the cat"}]},
    ]}))  # fmt: skip
    rec = tmp_path / "session.json"
    r = cli(home, "session", "run", script, "--model", plain_model, "--ctx", "64", "--chat-template", "chatml", "--out", rec, "-q")
    assert r.exit_code == 0, r.output
    data = json.loads(rec.read_text())
    assert data["schema_version"] == SESSION_SCHEMA_VERSION and data["chat_template"]["name"] == "chatml"
    assert data["chat_template_sha256"] == ChatTemplate.builtin("chatml").hash
    r = cli(home, "replay", rec, "--json")  # the recorded template is used: the model file has none
    assert r.exit_code == 0, r.output
    assert [row["result"] for row in json.loads(r.stdout)] == ["match", "match"]
    r = cli(home, "session", "run", script, "--model", plain_model, "--ctx", "64", "-q")
    assert r.exit_code == 2 and "has no chat template; sessions need one: pass --chat-template" in r.stderr


def test_interactive_chat_with_a_chat_template(home: Path, plain_model: Path, tmp_path: Path):
    from cli_helpers import runner

    from detinfer.cli import app

    rec = tmp_path / "chat.json"
    args = ["chat", "--model", str(plain_model), "--ctx", "64", "-n", "3", "--chat-template", "chatml", "--record", str(rec)]
    r = runner.invoke(app, args, input="hi there\n\n", env={"DETINFER_HOME": str(home), "COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    data = json.loads(rec.read_text())
    assert data["chat_template"]["origin"] == "builtin" and len(data["turns"]) == 1
    assert data["turns"][0]["appended_token_ids"][0] == 1  # <|im_start|> of the chatml rendering, parsed

"""Chat templates in the jinja2 sandbox: the model's template against llama.cpp's rendered prompt, and failures."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import gguf
import pytest

from detinfer.chat import ChatTemplate, load_messages, validate_messages
from detinfer.errors import DetinferError, InputError, TemplateError
from detinfer.gguf_file import ModelFile
from detinfer.tokenizer import Tokenizer

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
        ([USER[0], {"role": "user", "content": None}], "message 1 has a 'content' of type NoneType"),
        ([{"role": 3, "content": "a"}], "message 0 has a 'role' of type int"),
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
        ("[{\"role\": \"user\", \"content\": \"hi\"}", "invalid JSON at line 1 column"),
        ("{\"role\": \"user\", \"content\": \"hi\"}", "expected a list"),
        ("[{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"user\"}]", "message 1 has no 'content'"),
        (b"\xff\xfe[]", "cannot read"),
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

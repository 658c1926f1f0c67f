"""Issue 32, bounds that hold and the constraint contract as written: each reproduction as a test of the outcome.

Constraint files read like every input; invalid UTF-8 in a constraint named; template size bombs refused before
they build anything (peak RSS measured in a subprocess); control tokens unreachable from any grammar; oversized
constraints failing before the first token; stop strings that cut a constrained output; tool-call markup inside
arguments and tool names. The real SmolLM2 stands in wherever a vocabulary's control tokens or a model's choices
matter; the tiny synthetic model for the CLI runs in subprocesses (inputs that would hang if a check regressed).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jinja2.ext
import llguidance
import numpy as np
import pytest
from cli_helpers import cli, detinfer, one_error_line, resealed
from gguf_factory import CHATML
from jinja2.sandbox import ImmutableSandboxedEnvironment
from pydantic import ValidationError

from detinfer.api import load
from detinfer.compute import constrain
from detinfer.compute.constrain import (
    MAX_CONSTRAINT_BYTES,
    Constraint,
    Guide,
    check_tools,
    json_schema_constraint,
    tool_call_constraint,
)
from detinfer.compute.engine import Engine, set_threads
from detinfer.compute.generate import OPENAI_FINISH_REASON, generate
from detinfer.compute.sampling import Sampling
from detinfer.errors import ConstraintError, DetinferError
from detinfer.model.chat import ChatTemplate
from detinfer.model.sandbox import _tojson
from detinfer.model.tool_parsers import FORMATS
from detinfer.records.run import build_prompt, execute, reexecute_manifest


@pytest.fixture(scope="module")
def engine(model_path):
    set_threads(1)
    yield Engine.load(model_path, n_ctx=512)
    set_threads(None)


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("home")




def _tokens(engine, text: str, constraint: Constraint | None, max_tokens: int = 24, stop=()) -> tuple[list[int], str, str]:
    prompt = build_prompt(engine, text=text, chat=True)
    res_steps = list(generate(engine, prompt.token_ids, Sampling.create(max_tokens=max_tokens, stop=list(stop)), constraint=constraint))
    return [s.token for s in res_steps], "".join(s.text for s in res_steps), res_steps[-1].stop_reason


# ------------------------------------------------------------------------------------------ 1. constraint files


def test_constraint_files_are_read_like_every_input(home: Path, tiny_chat: Path, tmp_path: Path):
    """--grammar on a FIFO, --json-schema /dev/zero and an oversized (sparse) schema: one line, exit 2, at once."""
    fifo = tmp_path / "grammar.fifo"
    os.mkfifo(fifo)
    big = tmp_path / "big.schema.json"
    with open(big, "wb") as f:
        f.truncate(1 << 40)
    run = ["run", "--model", tiny_chat, "--prompt", "hi", "--ctx", "64", "--threads", "1", "-n", "4"]
    for args, needle in ((["--grammar", fifo], "cannot read --grammar file"), (["--json-schema", "/dev/zero"], "it is a character device"),
                         (["--json-schema", big], f"more than the limit of {MAX_CONSTRAINT_BYTES:,}")):  # fmt: skip
        t0 = time.perf_counter()
        one_error_line(detinfer(home, *run, *args, timeout=60), needle, "not a regular file" if "device" in needle else needle)
        assert time.perf_counter() - t0 < 30, args
    grammar = tmp_path / "ok.lark"  # negative control: a regular grammar file is read and enforced
    grammar.write_text('start: "ab"\n')
    r = detinfer(home, *run, "--grammar", grammar, "--out", tmp_path / "run.json", timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "run.json").read_text())["output"]["text"] == "ab"


ARGV_CASES = {
    "regex": ([b"-p", b"hi", b"--regex", b"a\xff"], "--regex is not valid UTF-8: byte 0xff at character 1"),
    "stop": ([b"-p", b"hi", b"--stop", b"\xff"], "stop string 0 is not valid UTF-8: byte 0xff at character 0"),
    "prompt": ([b"-p", b"h\xffi"], "the prompt is not valid UTF-8: byte 0xff at character 1"),
    "system": ([b"-p", b"hi", b"--chat", b"--system", b"\xfe"], "message 0's 'content' is not valid UTF-8: byte 0xfe at character 0"),
    "max-tokens": ([b"-p", b"hi", b"-n", b"2147483648"], "--max-tokens 2147483648: must be at most 2147483647"),
    "valid": ([b"-p", "é".encode(), b"--stop", "é".encode(), b"--regex", "[a-zé]+".encode(), b"-n", b"2147483647"], None),
}


@pytest.mark.parametrize("case", list(ARGV_CASES))
def test_invalid_arguments_are_one_line_exit_2(home: Path, tiny_chat: Path, case: str):
    """Undecodable argv bytes reach Python as lone surrogates (``$'a\\xff'`` is 'a\\udcff'): each is named, one line,
    exit 2, never a UnicodeEncodeError; so is ``-n 2**31``. Negative control: the same options, valid, run."""
    args, needle = ARGV_CASES[case]
    env = dict(os.environ, DETINFER_HOME=str(home), COLUMNS="200")
    argv = [sys.executable.encode(), b"-m", b"detinfer.cli", b"run", b"--model", bytes(tiny_chat), b"--ctx", b"64", b"--threads", b"1",
            b"--quiet", *args]  # fmt: skip
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    if needle is None:
        assert r.returncode == 0, r.stderr
    else:
        one_error_line(r, needle)


def test_invalid_utf8_in_a_constraint_is_named():
    """A lone surrogate in a constraint's text (an argv byte, a JSON \\ud800 escape) is a ConstraintError naming it."""
    for text, needle in (("a\udcff", "byte 0xff"), ("\ud800", "the lone surrogate \\ud800")):
        with pytest.raises(ConstraintError, match=re.escape(needle)):
            Constraint.create("regex", text, source="--regex")
    with pytest.raises(ConstraintError, match="lone surrogate"):
        json_schema_constraint({"const": "\ud800"})
    with pytest.raises(ConstraintError, match="the JSON Schema is nested deeper than"):
        Constraint.create("json_schema", '{"a":' * 5000 + "1" + "}" * 5000)
    deep: dict = {}
    for _ in range(100_000):  # a parsed schema from the API, nested past what json.dumps recurses
        deep = {"not": deep}
    with pytest.raises(ConstraintError, match="nested too deeply to serialize"):
        json_schema_constraint(deep)


def test_out_of_range_integers_are_bad_input_in_the_library_and_one_batch_line(home: Path, tiny_chat: Path, tmp_path: Path):
    """max_tokens 2**31 (and the other integer options past their ranges) raise a DetinferError from the library,
    never pydantic's ValidationError; in a batch only that line is bad input. Controls: the largest valid values
    pass, and the batch's good line is written."""
    llm = load(tiny_chat, n_ctx=64, threads=1)
    for bad in (dict(max_tokens=2**31), dict(seed=2**64), dict(top_k=2**63), dict(repeat_last_n=-1), dict(stop=["\udcff"])):
        with pytest.raises(DetinferError) as e:
            llm.stream("hi", **bad)
        assert not isinstance(e.value, ValidationError) and "\n" not in str(e.value), bad
    script = {"turns": [{"messages": [{"role": "user", "content": "hi"}], "sampling": {"max_tokens": 2**31}}]}
    with pytest.raises(DetinferError, match="max_tokens=2147483648"):
        llm.session(script)
    assert Sampling.create(max_tokens=2**31 - 1, seed=2**64 - 1, top_k=2**63 - 1).max_tokens == 2**31 - 1
    lines = [{"id": "big", "prompt": "hi", "sampling": {"max_tokens": 2**31}}, {"id": "ok", "prompt": "hi", "sampling": {"max_tokens": 2}}]
    batch = tmp_path / "batch.jsonl"
    batch.write_text("".join(json.dumps(x) + "\n" for x in lines))
    r = cli(home, "batch", batch, "--out-dir", tmp_path / "out", "--model", tiny_chat, "--ctx", "64", "--threads", "1")
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert f"{batch}:1: sampling.max_tokens" in r.output and "1 written" in r.output and "1 bad input" in r.output, r.output
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["ok.json"]
    # a batch's runs cannot mismatch, so its progress counts none (verify's does: test_distributed)
    assert "[2/2] ok: written (2 tokens, " in r.stderr and "mismatch" not in r.stderr and "ran 2/2 in this process" in r.stderr, r.stderr


def test_resume_runs_a_damaged_manifest_again(home: Path, tiny_chat: Path, tmp_path: Path):
    """``batch --resume`` re-validates what is already written: a truncated manifest is run again and replaced by a
    whole one, never counted as done. Control: an undamaged folder is skipped whole."""
    batch = tmp_path / "batch.jsonl"
    batch.write_text("".join(json.dumps({"id": i, "prompt": "hi", "sampling": {"max_tokens": 2}}) + "\n" for i in ("a", "b")))
    args = ("batch", batch, "--out-dir", tmp_path / "out", "--model", tiny_chat, "--ctx", "64", "--threads", "1")
    assert cli(home, *args).exit_code == 0
    whole = (tmp_path / "out" / "b.json").read_bytes()
    r = cli(home, *args, "--resume")
    assert r.exit_code == 0 and "2 skipped" in r.output, r.output
    (tmp_path / "out" / "b.json").write_bytes(whole[: len(whole) // 2])
    r = cli(home, *args, "--resume")
    assert r.exit_code == 0 and "1 skipped" in r.output and "1 written" in r.output, r.output
    assert (tmp_path / "out" / "b.json").read_bytes() == whole


def test_junit_xml_at_a_special_path_fails_before_anything_runs(home: Path, tiny_chat: Path, tmp_path: Path):
    """``verify --junit-xml`` at a FIFO, a symbolic link or /dev/null is one line naming the option, exit 2, before
    any record is re-executed (no result row), and the special file is left as it was. Control: a new path gets the
    report after the run."""
    manifest = tmp_path / "run.json"
    assert cli(home, "run", "--model", tiny_chat, "--prompt", "hi", "--max-tokens", "2", "--ctx", "64", "--threads", "1",
               "--out", manifest, "--quiet").exit_code == 0  # fmt: skip
    fifo, link = tmp_path / "fifo", tmp_path / "link.xml"
    os.mkfifo(fifo)
    link.symlink_to(tmp_path / "elsewhere.xml")
    for target in (fifo, link, Path("/dev/null")):
        r = cli(home, "verify", manifest, "--model", tiny_chat, "--junit-xml", target)
        one_error_line(r, "--junit-xml")
        assert "match" not in r.output, r.output
    assert fifo.is_fifo() and link.is_symlink() and not (tmp_path / "elsewhere.xml").exists()
    r = cli(home, "verify", manifest, "--model", tiny_chat, "--junit-xml", tmp_path / "report.xml")
    assert r.exit_code == 0 and 'failures="0"' in (tmp_path / "report.xml").read_text(), r.output


# ------------------------------------------------------------------------------------------ 2. template size bombs

S4M = "{% set s = 'x' * 4000000 %}"
BOMBS = {
    "format-filter": ("{{ '%02000000000d'|format(1) }}", "the format filter would make"),
    "percent": ("{{ '%02000000000d' % 1 }}", "'%' would make"),
    "percent-star": (S4M + "{{ ('%*d' * 100) % ((16000000, 1) * 100) }}", "'%' would make"),
    "percent-repeats": (S4M + "{{ ('%s' * 100) % ((s,) * 100) }}", "'%' would make"),
    "str.format-width": ("{{ '{:>99999999}'.format(1) }}", "str.format would make"),
    "str.format-many": ("{{ ('{:>9999999}' * 100).format(*range(100)) }}", "str.format would make"),
    "str.format-repr": (S4M + "{{ '{!r}{!r}{!r}{!r}{!r}'.format(s, s, s, s, s) }}", "str.format would make"),
    "center": ("{{ 'x'|center(10**9) }}", "limit"),
    "ljust": ("{{ 'x'.ljust(16000000) ~ 'x'.ljust(16000000) }}", "'~' would make"),
    "star": ("{{ 'ab' * 1000000000 }}", "'*' would make"),
    "star-list": (S4M + "{{ [s] * 16000000 }}", "'*' would build"),
    "concat-of-a-list": (S4M + "{{ [s] * 10 ~ '' }}", "'~' would make"),
    "join": ("{% set s = 'x' * 8000000 %}{{ range(1000)|map('string')|join(s) }}", "the join filter would make"),
    "str.join": (S4M + "{{ ''.join([s] * 10) }}", "str.join would make"),
    "replace": ("{% set s = 'x' * 8000000 %}{{ s|replace('x', 'yyy') }}", "the replace filter would make"),
    "wordwrap": ("{% set s = 'a b ' * 2000000 %}{{ s|wordwrap(1) }}", "the wordwrap filter would build"),
    "indent": ("{% set s = '\n' * 1000000 %}{{ s|indent(100) }}", "the indent filter would make"),
    "truncate": ("{% set s = 'x' * 16000000 %}{{ s|truncate(16000000, end=s) }}", "the truncate filter would make"),
    "list": ("{% set s = 'x' * 8000000 %}{{ s|list|length }}", "the list filter would build"),
    "string": (S4M + "{{ ([s] * 10)|string }}", "the string filter would make"),
    "tojson-indent": ("{{ {'a': 1}|tojson(indent=16000000) }}", "the tojson filter would make"),
    "pprint": ("{% set s = 'x' * 1000 %}{{ ([[s] * 1000] * 1000)|pprint }}", "the pprint filter would make"),
    "sum": ("{% set l = [1] * 4000000 %}{{ [l, l, l, l]|sum(start=[]) }}", "the sum filter would make"),
    "batch": ("{{ [1]|batch(16000000, 'x')|list }}", "the batch filter would build"),
    "split": ("{% set s = 'a ' * 4000000 %}{{ s.split()|length }}", "str.split would build"),
    "expandtabs": ("{% set s = '\t' * 1000000 %}{{ s.expandtabs(100) }}", "str.expandtabs would make"),
    "print-a-list": ("{% set s = 'x' * 1000 %}{{ [[s] * 1000] * 1000 }}", "printing a value would make"),
    "block-output": (S4M + "{% set t %}{% for i in range(100) %}{{ s }}{% endfor %}{% endset %}{{ t|length }}", "a block's output"),
    "macro-output": (S4M + "{% macro m() %}{{ s }}{{ s }}{{ s }}{{ s }}{{ s }}{% endmacro %}{{ m() }}", "a block's output"),
}
PEAK_RSS_MB = 200
PROBE = textwrap.dedent("""
    import json, resource, sys, time
    from detinfer.model.chat import ChatTemplate
    from detinfer.errors import TemplateError

    def peak_rss_mb():  # this process image's high-water RSS: ru_maxrss would keep the forking parent's across exec
        try:
            with open("/proc/self/status") as f:
                return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmHWM:"))
        except OSError:
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024

    for name, source in json.loads(sys.argv[1]).items():
        t0 = time.process_time()
        try:
            outcome = "rendered %d characters" % len(ChatTemplate(source).render([{"role": "user", "content": "hi"}]))
        except TemplateError as e:
            outcome = "TemplateError: " + str(e)
        print(json.dumps({"name": name, "outcome": outcome, "cpu_s": time.process_time() - t0, "peak_rss_mb": peak_rss_mb()}), flush=True)
    if len(sys.argv) > 2:  # the control: a real 300 MB allocation must show in the same measurement
        block = bytearray(300 * 2**20)
        print(json.dumps({"name": "control", "peak_rss_mb": peak_rss_mb()}))
""")


def test_template_size_bombs_fail_before_they_build(tmp_path: Path):
    """Each operation that can build far more than it is given is sized before it runs: a one-line TemplateError
    at once, and the render process never passes ~200 MB (it would reach gigabytes). Negative control: the same
    peak-RSS probe sees a real 300 MB allocation."""
    r = subprocess.run([sys.executable, "-c", PROBE, json.dumps({k: v[0] for k, v in BOMBS.items()}), "control"],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    rows = {row["name"]: row for row in map(json.loads, r.stdout.splitlines())}
    for name, (_, needle) in BOMBS.items():
        row = rows[name]
        assert row["outcome"].startswith("TemplateError: chat template stopped") and needle in row["outcome"], (name, row)
        assert "\n" not in row["outcome"] and row["cpu_s"] < 2, (name, row)
        assert row["peak_rss_mb"] < PEAK_RSS_MB, (name, row)
    assert rows["control"]["peak_rss_mb"] > rows[list(BOMBS)[-1]]["peak_rss_mb"] + 250, rows["control"]


EQUIVALENT = [
    "{{ '%05d|%-4s|%.2f' % (3, 'ab', 1.234) }}{{ '%(a)s-%(b)r' % {'a': 1, 'b': 'q'} }}{{ '%*d|%.*f' % (5, 3, 2, 3.14159) }}",
    "{{ '%s'|format('x') }}{{ '%(n)s'|format(n=2) }}{{ '{:>5}|{:.3}|{!r}'.format('a', 'bcdef', 'q') }}{{ '{0}{1}{0}'.format(1, 2) }}",
    "{{ '{a[0]}-{b}'.format_map({'a': [1], 'b': 2}) }}{{ ('<b>{}</b>'|safe).format('<i>') }}",
    "{{ 'x'|center(9) }}|{{ 'a\nb\nc'|indent(2, true) }}|{{ 'aa bb cc dd'|wordwrap(5) }}|{{ 'abcabc'|replace('b', 'XY', 1) }}",
    "{{ [1, 'a', none]|join('-') }}{{ range(3)|map('string')|join }}{{ 'hello world'|truncate(8, leeway=0) }}",
    "{{ 'abc'|list }}{{ [3, 1, 2]|sort }}{{ 'abc'|reverse }}{{ {'b': 1, 'a': 2}|dictsort }}{{ [1, [2]]|string }}{{ {'a': [1, 'x']}|pprint }}",
    "{{ {'a': [1, 'é\n']}|tojson }}{{ {'a': [1]}|tojson(indent=2) }}{{ [[1], [2]]|sum(start=[]) }}{{ [1, 2, 3]|batch(2, 0)|list }}",
    "{{ '<&>'|e }}{{ 'a b'|urlencode }}{{ 'x.com'|urlize }}{{ 'ab'|upper }}{{ 'AB cd'|title }}{{ 'a b c'|wordcount }}{{ '<p>x</p>'|striptags }}",
    "{{ 'ab' * 3 }}{{ [1] * 2 }}{{ 'a' ~ [1] ~ 2 }}{{ 'a' + 'b' }}{{ [1] + [2] }}",
    "{% macro m(x) %}<{{ x }}>{% endmacro %}{{ m(1) }}{% set t %}a{{ 1 }}b{% endset %}{{ t }}{% filter upper %}q{% endfilter %}",
    "{{ ','.join(['a', 'b']) }}{{ 'a-b'.split('-') }}{{ 'a\nb'.splitlines() }}{{ 'x'.ljust(3) }}|{{ '\tx'.expandtabs(4) }}",
    "{% set ns = namespace(a=1) %}{{ ns.a }}{{ [ns]|length }}{{ {'a': 1}.items()|list }}{{ messages }}{{ 'ab'.translate({97: 'zz'}) }}",
]


@pytest.mark.parametrize("source", EQUIVALENT)
def test_sized_operations_render_what_jinja_renders(source: str):
    """The sizing changes no output: the same operations at ordinary sizes render exactly as jinja2's own sandbox."""
    plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    plain.filters["tojson"] = _tojson
    messages = [{"role": "user", "content": "hi"}]
    assert ChatTemplate(source).render(messages) == plain.from_string(source).render(messages=messages)


def _peak_rss_mb(home: Path, *args) -> tuple[subprocess.CompletedProcess, int]:
    """``detinfer ARGS`` in a fresh parent process that reports its only child's peak RSS."""
    wrapper = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
               "sys.stderr.write(r.stderr); sys.stdout.write(r.stdout); "
               "print('PEAK_RSS_MB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024); sys.exit(r.returncode)")  # fmt: skip
    env = dict(os.environ, DETINFER_HOME=str(home), COLUMNS="200")
    r = subprocess.run([sys.executable, "-c", wrapper, sys.executable, "-m", "detinfer.cli", *map(str, args)], env=env,
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    return r, int(r.stdout.rsplit("PEAK_RSS_MB", 1)[1])


def test_resealed_manifest_with_a_format_bomb_fails_verify_fast_as_bad_input(home: Path, tiny_chat: Path, tmp_path: Path):
    (tmp_path / "chatml.jinja").write_text(CHATML)
    r = cli(home, "run", "--model", tiny_chat, "--chat", "--chat-template", tmp_path / "chatml.jinja", "--prompt", "hi",
            "--max-tokens", "2", "--ctx", "64", "--threads", "1", "--out", tmp_path / "run.json", "--quiet")  # fmt: skip
    assert r.exit_code == 0, r.output
    good = json.loads((tmp_path / "run.json").read_text())
    bomb = "{{ '%02000000000d'|format(1) }}" + CHATML
    data = json.loads(json.dumps(good))
    sha = hashlib.sha256(bomb.encode()).hexdigest()
    data["chat_template"].update(source=bomb, sha256=sha)
    data["chat_template_sha256"] = sha
    bad = resealed(data, tmp_path / "bad.json")
    t0 = time.perf_counter()
    r, bad_rss = _peak_rss_mb(home, "verify", bad, "--model", tiny_chat, "--json", "--threads", "1")
    rows = [x for x in map(json.loads, r.stdout.splitlines()[:-1]) if "path" in x]
    assert r.returncode == 2 and rows[0]["status"] == "bad input" and "the format filter would make" in rows[0]["message"], r.stdout
    assert time.perf_counter() - t0 < 60
    r, good_rss = _peak_rss_mb(home, "verify", resealed(good, tmp_path / "good.json"), "--model", tiny_chat, "--threads", "1")
    assert r.returncode == 0, r.stderr  # negative control: the same manifest with its own template verifies
    assert bad_rss < good_rss + 100, (bad_rss, good_rss)  # the 2 GB string was never built


# ------------------------------------------------------------------------------------------ 3. control tokens

FORCES_IM_START = 'start: "Hello" <|im_start|> "user\\n" /[a-z ]+/\n'


@pytest.mark.parametrize("grammar, needle", [
    (FORCES_IM_START, "control token <|im_start|>"),
    ('start: "Hello" <[1]> /[a-z]+/\n', "token range <[1]> includes the control token 1 '<|im_start|>'"),
    ('start: "Hi" <[0-20]>\n', "token range <[0-20]> includes the control token 0"),
    ('start: "Hi" <[*]>\n', "token range <[*]> includes the control token 0"),
    ('start: "Hi" <[^5]>\n', "token range <[^5]> includes the control token 0"),
    ('start: "Hi" <|im_end|>\n', "control token <|im_end|>"),  # an end-of-generation token too: never named
    ('start: a\na: "x" | %lark {\nstart: <|im_start|>\n}\n', "control token <|im_start|>"),
])  # fmt: skip
def test_a_grammar_naming_a_control_token_is_refused_before_any_token(engine, grammar: str, needle: str):
    c = Constraint.create("lark", grammar)
    with pytest.raises(ConstraintError) as e:
        c.check(engine.tokenizer)
    assert needle in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConstraintError, match="control token"):
        next(generate(engine, [1, 2, 3], Sampling.create(max_tokens=4), constraint=c))


def test_grammars_that_only_name_text_and_ordinary_tokens_are_kept(engine):
    """Control-token names inside strings, regexes and comments are text, and a token range of ordinary tokens stays
    allowed; no mask of theirs ever allows a control token."""
    tok = engine.tokenizer
    for grammar in ('start: "<|im_start|>" /<[a-z]+>/ # <|im_end|>\n', 'start: "a" <[17-300]>\n', 'start: "a" <[^0-16]>\n'):
        guide, logits = Guide(Constraint.create("lark", grammar), tok), np.zeros(tok.n_vocab, np.float32)
        for _ in range(4):
            allowed = set(np.flatnonzero(np.isfinite(guide.mask(logits))).tolist())
            assert not allowed & (tok.special_ids - tok.eog_ids), grammar
            if allowed <= tok.eog_ids:
                break
            guide.consume(min(allowed - tok.eog_ids))


def test_no_grammar_reaches_a_control_token_even_unchecked(engine, monkeypatch):
    """The mask itself excludes control tokens: with the grammar check off, the grammar that forced id 1 dead-ends.
    Negative control: with the mask filter off too, the same grammar puts id 1 (<|im_start|>) in the output."""
    c = Constraint.create("lark", FORCES_IM_START)
    monkeypatch.setattr(constrain, "refuse_control_tokens", lambda constraint, tokenizer: None)
    with pytest.raises(ConstraintError, match="allows no next token"):
        _tokens(engine, "Say hello.", c)
    empty = np.array([], np.int64)
    monkeypatch.setattr(constrain, "control_ids", lambda tokenizer: (empty, empty))
    tokens, _, _ = _tokens(engine, "Say hello.", c)
    assert tokens[1] == 1 and engine.tokenizer.token_text(1) == "<|im_start|>", tokens


# ------------------------------------------------------------------------------------------ 6. oversized constraints

WIDE_LARK = "start: y\ny: " + " | ".join(f'"a" "{i}"' for i in range(2500)) + "\n"  # 31 KB: 2,500 items in a row
WIDE_JSON = json.dumps({"anyOf": [{"required": [f"a{i}"]} for i in range(2500)]})  # 61 KB: 5,002 items in a row
ARRAY_OF_WIDE = json.dumps({"type": "array", "items": {"anyOf": [{"required": [f"a{i}"]} for i in range(2400)]}})


@pytest.mark.parametrize("kind, text", [("lark", WIDE_LARK), ("json_schema", WIDE_JSON)], ids=["lark", "json"])
def test_wide_constraints_under_the_cap_decode(engine, monkeypatch, kind: str, text: str):
    """A rule with thousands of alternatives (well under the 64 KiB cap) decodes. Negative control: under
    llguidance's default of 2,000 items in a row (and without the trial decode) it compiled, then failed at its
    first token."""
    c = Constraint.create(kind, text)
    assert len(c.text.encode()) < MAX_CONSTRAINT_BYTES
    c.check(engine.tokenizer)
    tokens, _, reason = _tokens(engine, "Pick one.", c, max_tokens=6)
    assert len(tokens) >= 2 and reason in ("eos", "max_tokens")
    monkeypatch.setattr(constrain, "_ll", lambda: (llguidance, llguidance.LLParserLimits(verbose_errors=False)))
    monkeypatch.setattr(constrain, "PROBE_TOKENS", 0)
    c.check(engine.tokenizer)
    with pytest.raises(ConstraintError, match="failed at token .* after 0 tokens: .*Current row has"):
        _tokens(engine, "Pick one.", c, max_tokens=6)


def test_a_constraint_past_the_parser_limits_fails_before_the_first_token(engine, monkeypatch):
    """Wide alternatives behind an opening bracket: the Guide's trial decode meets llguidance's per-step item limit
    when the constraint is checked. Negative control: without the trial decode it compiles and fails a token in."""
    c = Constraint.create("json_schema", ARRAY_OF_WIDE)
    with pytest.raises(ConstraintError) as e:
        c.check(engine.tokenizer)
    assert "exceeds the parser's limits at token 1 of a trial decode" in str(e.value) and "\n" not in str(e.value)
    monkeypatch.setattr(constrain, "PROBE_TOKENS", 0)
    c.check(engine.tokenizer)
    steps = []
    with pytest.raises(ConstraintError, match="Too many items"):
        for step in generate(engine, build_prompt(engine, text="A list.", chat=True).token_ids, Sampling.create(max_tokens=8),
                             constraint=c):  # fmt: skip
            steps.append(step)
    assert steps, "the failure came after the first token"


# ------------------------------------------------------------------------------------------ 5. stop strings

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}  # fmt: skip


def test_a_stop_string_cutting_a_constrained_output_says_so(engine):
    """A stop string inside a constrained output ends it with "stop_cut" (OpenAI's finish_reason "length": cut short),
    recorded and replayed exactly. Negative controls: the same stop string without a constraint is a plain "stop";
    the constraint without it ends with "eos" and parses."""
    prompt = build_prompt(engine, text="Describe a person as JSON.", chat=True)
    schema = json_schema_constraint(PERSON)
    whole = execute(engine, prompt, Sampling.create(max_tokens=40), constraint=schema)
    assert whole.output.stop_reason == "eos" and set(json.loads(whole.output.text)) == {"name", "age"}
    cut = execute(engine, prompt, Sampling.create(max_tokens=40, stop=['"age"']), constraint=schema)
    assert cut.output.stop_reason == "stop_cut" and OPENAI_FINISH_REASON["stop_cut"] == "length"
    assert whole.output.text.startswith(cut.output.text) and '"age"' not in cut.output.text
    with pytest.raises(ValueError):
        json.loads(cut.output.text)
    actual, comparison = reexecute_manifest(cut, engine)
    assert comparison.match and actual.output.stop_reason == "stop_cut", comparison.differences
    free = execute(engine, prompt, Sampling.create(max_tokens=40, stop=["e"]))
    assert free.output.stop_reason == "stop", free.output.text


# ------------------------------------------------------------------------------------------ 4. tool calls

MARKUP_ARGUMENT = {"hermes": "</tool_call>", "mistral": "[TOOL_CALLS]", "llama3": "<|python_tag|>"}


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_a_forced_call_whose_argument_holds_call_markup_parses_as_the_call(engine, name: str):
    """A forced call whose generated argument contains the format's markup (``</tool_call>`` for hermes) is still
    the call: each call's JSON is read by a JSON decoder, so markup inside its strings is data."""
    fmt, markup = FORMATS[name], MARKUP_ARGUMENT[name]
    pattern = f"^[a-z]{{1,6}}{re.escape(markup)}[a-z]{{1,6}}$"
    params = {"type": "object", "properties": {"note": {"type": "string", "pattern": pattern}}, "required": ["note"],
              "additionalProperties": False}  # fmt: skip
    tools = [{"type": "function", "function": {"name": "save_note", "parameters": params}}]
    c = tool_call_constraint(tools, "save_note", prefix=fmt.prefix, suffix=fmt.suffix, arguments_key=fmt.arguments_key)
    _, text, reason = _tokens(engine, "Save a note.", c, max_tokens=80)
    assert reason == "eos", text
    reply = fmt.parse(text, {"save_note": params}, call_id_seed="seed")
    assert reply.content is None and len(reply.tool_calls) == 1, (text, reply)
    note = json.loads(reply.tool_calls[0]["function"]["arguments"])["note"]
    assert markup in note and re.match(pattern, note)
    if name == "hermes":  # negative control: the call's closing tag is in the text twice, so splitting on it cuts the JSON
        assert text.count("</tool_call>") == 2
        body = re.split(r"<tool_call>(.*?)(?:</tool_call>|\Z)", text, flags=re.S)[1]
        with pytest.raises(ValueError):
            json.loads(body)


@pytest.mark.parametrize("bad", ["get weather", "</tool_call>", "x" * 65, "naïve", "a.b"])
def test_tool_names_are_openai_function_names(bad: str):
    tools = [{"type": "function", "function": {"name": "get_weather-2"}}, {"type": "function", "function": {"name": bad}}]
    with pytest.raises(ConstraintError) as e:
        check_tools(tools)
    assert f"tools[1] is named {bad[:80]!r}" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConstraintError, match="tools\\[1\\] is named"):
        tool_call_constraint(tools)
    assert [f["name"] for f in check_tools(tools[:1])] == ["get_weather-2"]  # negative control: a valid name passes

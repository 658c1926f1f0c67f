"""Fuzzing every input detinfer reads: each ends in a result or a one-line DetinferError, never anything else.

The strategies and checks live in tests/fuzz.py (the offline `make fuzz` runner uses the same ones with
10,000 examples per target, in worker processes with NUMBA_BOUNDSCHECK=1); here each target runs a bounded
number of hypothesis examples in-process. Also here: chat-template limits and sandbox escapes, and one short
forward + generation with numba bounds checking on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
import fuzz  # noqa: E402
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402

from detinfer.errors import TemplateError  # noqa: E402
from detinfer.model import sandbox  # noqa: E402
from detinfer.model.chat import ChatTemplate  # noqa: E402
from detinfer.model.sandbox import MAX_RENDER_CHARS  # noqa: E402

EXAMPLES = {"gguf": 250, "manifest": 300, "session": 300, "script": 300, "detkv": 300, "template": 300, "http": 200,
            "template_loops": 40, "deep_json": 80, "special_files": 150,
            "template_bombs": 60, "constraints": 150, "snapshots": 150, "tool_schemas": 150, "cache": 60}
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> fuzz.Corpus:
    return fuzz.build_corpus(tmp_path_factory.mktemp("fuzz-corpus"))


@pytest.mark.parametrize("name", list(fuzz.TARGETS))
def test_fuzz_target(corpus: fuzz.Corpus, name: str) -> None:
    """Every mutated input of ``name`` is accepted or refused with a one-line DetinferError (first offender named)."""
    target = fuzz.TARGETS[name]
    scratch = corpus.folder / f"in-{name}"
    seen: dict[str, int] = {}

    @settings(max_examples=EXAMPLES[name], deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate, Phase.shrink], suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(target.strategy(corpus))
    def run(case) -> None:
        outcome, detail = fuzz.classify(lambda: target.check(corpus, case, scratch))
        seen[outcome] = seen.get(outcome, 0) + 1
        assert outcome in (fuzz.OK, fuzz.REJECTED), f"{outcome}: {detail}"

    run()
    if target.refuses:
        assert seen.get(fuzz.REJECTED), f"no input of {name} was rejected: the mutations do not bite ({seen})"
    else:  # the cache target: every input gives the clean result; the damage must still be noticed
        assert fuzz.cache_corpus(corpus).warned, f"no damaged file of {name} was noticed: the mutations do not bite ({seen})"


def test_gguf_truncated_at_every_boundary(corpus: fuzz.Corpus) -> None:
    """Cutting the valid model at each section boundary (and one byte either side) is always a GGUFError-class refusal."""
    for name, fields in corpus.gguf_fields.items():
        size = len(corpus.gguf[name])
        cuts = sorted({max(0, b + d) for b in fields.boundaries for d in (-1, 0, 1)} - {size, size + 1})
        for cut in cuts:
            outcome, detail = fuzz.classify(lambda: fuzz.check_gguf(corpus, (name, (("truncate", cut),)), corpus.folder / "cut.gguf"))
            assert outcome == fuzz.REJECTED, f"{name} cut at byte {cut}: {outcome} {detail}"


@pytest.mark.parametrize("variant", ["block-count-array", "embd-as-float", "head-count-as-string", "eps-nan", "rope-base-zero"])
def test_metadata_of_the_wrong_type_is_rejected(corpus: fuzz.Corpus, variant: str) -> None:
    """A list, a string, a fractional or non-finite value where the config needs a number: ConfigError, never truncated."""
    outcome, detail = fuzz.classify(lambda: fuzz.check_gguf(corpus, (variant, ()), corpus.folder / "meta.gguf"))
    assert outcome == fuzz.REJECTED and "ConfigError" in detail, f"{outcome}: {detail}"


# ------------------------------------------------------------------------------------------ template safety

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__ }}",
        "{{ cycler.__init__.__globals__.os }}",
        "{{ lipsum.__globals__['os'].popen('id').read() }}",
        "{{ raise_exception.__globals__ }}",
        "{{ namespace.__init__.__globals__ }}",
        "{% import 'os' as os %}{{ os }}",
        "{% include '/etc/passwd' %}",
        "{{ messages.append(1) }}",
    ],
)
def test_template_cannot_reach_python_internals(source: str) -> None:
    with pytest.raises(TemplateError) as e:
        ChatTemplate(source).render(MESSAGES)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("source", "needle"),
    [
        ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "steps"),
        ("{% for i in range(1000000) %}{% endfor %}", "range"),
        ("{{ 'a' * 1000000000 }}", "limit"),
        ("{{ 2 ** 100000000 }}", "exponent"),
        ("{{ 'x' | center(1000000000) }}", "limit"),
        ("{{ '{:>1000000000}'.format(1) }}", "str.format would make a value"),
        ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}", "limit"),
        ("{% for i in range(100000) %}{{ 'abcdefghij' * 100 }}{% endfor %}", "characters"),
        ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
    ],
)
def test_template_runaway_is_stopped(source: str, needle: str, monkeypatch) -> None:
    """Loops that (nearly) never end and huge outputs stop with a clear one-line TemplateError, in bounded time."""
    if needle == "steps":  # the step limit on its own: 10^6 steps take over 1 s of CPU on a slow machine
        monkeypatch.setattr(sandbox, "MAX_RENDER_CPU_S", 60.0)
    t0 = time.perf_counter()
    with pytest.raises(TemplateError) as e:
        ChatTemplate(source).render(MESSAGES)
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert time.perf_counter() - t0 < 10


def test_template_limits_leave_real_templates_alone() -> None:
    """range() still behaves like a list, and a long but legitimate conversation renders."""
    t = ChatTemplate("{% for i in range(5)|reverse %}{{ i }}{% endfor %}{{ range(3)|list }}{{ range(4)|length }}")
    assert t.render(MESSAGES) == "43210[0, 1, 2]4"
    chatml = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    long = [{"role": "user", "content": "x" * 1000}] * 2000
    assert len(ChatTemplate(chatml).render(long)) > 2_000_000 < MAX_RENDER_CHARS


# ------------------------------------------------------------------------------------------ bounds checking


def test_forward_and_generation_under_numba_boundscheck(tmp_path: Path) -> None:
    """A forward pass and a short sampled generation with NUMBA_BOUNDSCHECK=1 (fresh numba cache: every kernel
    recompiles with bounds checks, ~20 s on 2 cores): no kernel indexes out of bounds, and the tokens equal
    the unchecked build's."""
    script = f"""
import sys
sys.path.insert(0, {str(REPO / 'tests')!r})
from gguf_factory import CHATML, write_tiny_gguf
from detinfer.compute.engine import Engine
from detinfer.compute.generate import generate
from detinfer.model.gguf_file import ModelFile
from detinfer.compute.sampling import Sampling
path = write_tiny_gguf({str(tmp_path / 'tiny.gguf')!r}, chat_template=CHATML, matrix_type=sys.argv[1])
engine = Engine(ModelFile(path, use_index=False), n_ctx=16)
prompt = engine.tokenizer.encode("hi there, the cat")
steps = list(generate(engine, prompt, Sampling(temperature=0.8, seed=3, max_tokens=16)))
print(",".join(str(s.token) for s in steps), steps[-1].stop_reason)
"""
    outputs = {}
    for mode in ("checked", "unchecked"):
        env = dict(os.environ, PYTHONPATH=str(REPO))
        if mode == "checked":
            env.update(NUMBA_BOUNDSCHECK="1", NUMBA_CACHE_DIR=str(tmp_path / "numba-cache"))
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", script, "Q4_1"], env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        outputs[mode] = proc.stdout.strip()
        print(f"{mode}: {time.perf_counter() - t0:.1f} s")
    assert outputs["checked"] == outputs["unchecked"]
    assert outputs["checked"].endswith("length") or outputs["checked"].split()[-1] in ("eos", "max_tokens")


def test_corrupt_count_that_would_exhaust_memory_is_a_gguf_error(corpus: fuzz.Corpus) -> None:
    """The input `make fuzz` found: one flipped bit in the tokenizer metadata makes gguf's reader allocate without
    bound (the worker was killed for memory); the reader's reads are bounded by the file and a budget, so it is a GGUFError."""
    outcome, detail = fuzz.classify(lambda: fuzz.check_gguf(corpus, ("valid-q4_1", (("flip", 3653, 2),)), corpus.folder / "oom.gguf"))
    assert outcome == fuzz.REJECTED and ("past the end of the file" in detail or "metadata items" in detail), detail


def test_json_edits_that_index_an_object_with_a_number_use_its_string_key() -> None:
    """The harness error `make fuzz` found (counted against the script target): a path that set ``turns`` to an
    object and then indexed it with 0 made an int key, and json.dumps(sort_keys=True) failed on int vs str keys."""
    case = ([("set", ("turns",), {"a": 1}), ("set", ("turns", 0), "x")], False, [])
    assert json.loads(fuzz.apply_json_ops({"turns": []}, case, None)) == {"turns": {"a": 1, "0": "x"}}

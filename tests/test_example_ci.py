"""examples/ci/ run exactly as a user runs it: `pytest` in a copy of the project (the plugin comes from the
installed detinfer's entry point), passing as committed, failing with the first-divergence message once a
snapshot token is perturbed, rewritten by --snapshot-update; then `detinfer verify --junit-xml` and the GitHub
annotations on its snapshots and manifests."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

from detinfer.compute.jit import host_level

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "ci"
SNAPSHOTS = Path("tests/__snapshots__/test_prompts")
CAPITAL = SNAPSHOTS / "test_prompt[capital].json"
DETINFER = [sys.executable, "-m", "detinfer.cli"]
WORKFLOW = EXAMPLE / ".github" / "workflows" / "detinfer.yml"


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Path:
    dest = tmp_path_factory.mktemp("user") / "ci"
    shutil.copytree(EXAMPLE, dest)
    return dest


def run(cmd: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600, env={**os.environ, **env})


def pytest_in(project: Path, *args: str) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--detinfer-threads", "1", *args], project)


def perturb(path: Path, step: int, token: int) -> dict:
    """Replace one output token id of a run snapshot; returns the original data."""
    data = json.loads(path.read_text())
    edited = dict(data, output_token_ids=[token if i == step else t for i, t in enumerate(data["output_token_ids"])])
    path.write_text(json.dumps(edited, indent=2, sort_keys=True) + "\n")
    return data


def test_the_example_passes_fails_on_a_perturbed_token_and_updates(project: Path):
    r = pytest_in(project)
    assert r.returncode == 0 and "4 passed" in r.stdout, r.stdout + r.stderr

    original = (project / CAPITAL).read_bytes()
    data = perturb(project / CAPITAL, 5, 3575)
    r = pytest_in(project)
    assert r.returncode == 1 and "1 failed, 3 passed" in r.stdout, r.stdout + r.stderr
    paris = data["output_token_ids"][5]
    assert "first divergent step 5 (of 8 expected, 8 generated):" in r.stdout
    assert "expected token 3575 ' capital'" in r.stdout and f"actual token   {paris} ' Paris'" in r.stdout
    top = next(line for line in r.stdout.splitlines() if "top-5 logits there (actual run):" in line)
    assert top.split(": ", 1)[1].startswith(f"{paris} ' Paris' ") and top.count("'") == 10  # five (id 'text' logit)
    readme = (EXAMPLE.parent.parent / "README.md").read_text()
    shown = [line.strip() for line in readme.splitlines() if line.strip().startswith("E   ")]
    assert len(shown) == 5 and all(line in r.stdout for line in shown)  # the README shows this very message

    r = pytest_in(project, "--snapshot-update")
    assert r.returncode == 0 and "1 snapshot updated" in r.stdout, r.stdout + r.stderr
    assert (project / CAPITAL).read_bytes() == original


def test_a_perturbed_session_names_its_turn(project: Path, tmp_path: Path):
    session = project / SNAPSHOTS / "test_agent_session.json"
    original = session.read_bytes()
    data = json.loads(original)
    expected = data["turns"][1]["output_token_ids"][2] + 1
    data["turns"][1]["output_token_ids"][2] = expected
    session.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    try:
        r = pytest_in(project, "-k", "session")
    finally:
        session.write_bytes(original)
    assert r.returncode == 1 and "turn 2, first divergent step 2 (of" in r.stdout, r.stdout + r.stderr
    assert f"expected token {expected} " in r.stdout and "top-5 logits there (actual run)" in r.stdout


def test_a_hostile_stored_snapshot_fails_with_its_reason(project: Path):
    """Stored files are read as records are: 100,000-deep JSON, a string token id and a FIFO each fail their test
    with one reason (no RecursionError, no tokenizer error, no hang); the negative control is the passing run above."""
    names = {"capital": CAPITAL, "haiku": SNAPSHOTS / "test_prompt[haiku].json", "session": SNAPSHOTS / "test_agent_session.json"}
    originals = {k: (project / p).read_bytes() for k, p in names.items()}
    try:
        (project / names["capital"]).write_text("[" * 100_000 + "]" * 100_000)
        haiku = json.loads(originals["haiku"])
        (project / names["haiku"]).write_text(json.dumps(dict(haiku, output_token_ids=["x", *haiku["output_token_ids"][1:]])))
        (project / names["session"]).unlink()
        os.mkfifo(project / names["session"])
        r = pytest_in(project, "-k", "capital or haiku or session")
    finally:
        for k, p in names.items():
            (project / p).unlink(missing_ok=True)
            (project / p).write_bytes(originals[k])
    out = r.stdout + r.stderr
    assert r.returncode == 1 and "3 failed" in r.stdout, out
    assert "the stored snapshot is nested deeper than" in out and "output_token_ids.0" in out and "is a FIFO" in out, out
    assert out.count("rewrite it with pytest --snapshot-update") >= 3, out
    assert "RecursionError" not in out and "TokenizerError" not in out, out


def test_opting_out_removes_the_fixtures(project: Path):
    r = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:detinfer", "-k", "capital"], project)
    assert r.returncode == 1 and "fixture 'detinfer_llm' not found" in r.stdout, r.stdout + r.stderr


def test_verify_writes_junit_and_github_annotations(project: Path, tmp_path: Path):
    """One test case per manifest, session record and snapshot (run or session), each re-executed."""
    r = run([*DETINFER, "verify", "manifests/", "sessions/", str(SNAPSHOTS), "--threads", "1", "--junit-xml", str(tmp_path / "ok.xml")], project)
    assert r.returncode == 0, r.stdout + r.stderr
    suite = ET.parse(tmp_path / "ok.xml").getroot().find("testsuite")
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors")) == ("7", "0", "0")
    names = [c.get("name") for c in suite.iter("testcase")]
    assert names[:3] == ["manifests/capital.json", "manifests/haiku.json", "sessions/agent.json"] and str(CAPITAL) in names

    bad, bad_session = tmp_path / "capital.json", tmp_path / "session.json"
    shutil.copy(project / CAPITAL, bad)
    perturb(bad, 5, 3575)
    session = json.loads((project / SNAPSHOTS / "test_agent_session.json").read_text())
    session["turns"][2]["output_text"] += "!"
    bad_session.write_text(json.dumps(session))
    files = [str(project / "manifests" / "capital.json"), str(bad), str(bad_session)]
    r = run([*DETINFER, "verify", *files, "--threads", "1", "--junit-xml", str(tmp_path / "bad.xml")], project, GITHUB_ACTIONS="true")
    assert r.returncode == 1, r.stdout + r.stderr
    cases = {c.get("name"): c for c in ET.parse(tmp_path / "bad.xml").getroot().iter("testcase")}
    assert cases[files[0]].find("failure") is None
    failure = cases[str(bad)].find("failure")
    assert failure.get("type") == "mismatch" and "first divergent step 5: expected token 3575 ' capital'" in failure.text
    assert cases[str(bad_session)].find("failure").get("message") == "turn 3 differs: text"
    annotations = [line for line in r.stdout.splitlines() if line.startswith("::error ")]
    assert [a.split("::")[1] for a in annotations] == [f"error file={f},title=detinfer verify%3A mismatch" for f in files[1:]]
    assert "%0A  first divergent step 5" in annotations[0]
    r = run([*DETINFER, "verify", *files, "--threads", "1"], project)  # off GitHub: no annotation lines
    assert r.returncode == 1 and "::error" not in r.stdout


def workflow_step(name: str) -> str:
    """The shell script of the example workflow's step whose name starts with ``name``."""
    steps = yaml.safe_load(WORKFLOW.read_text())["jobs"]["determinism"]["steps"]
    return next(step["run"] for step in steps if step.get("name", "").startswith(name))


def workflow_env() -> dict[str, str]:
    """The job's environment values that are not GitHub expressions (the compile target's level)."""
    env = yaml.safe_load(WORKFLOW.read_text())["jobs"]["determinism"]["env"]
    return {k: str(v) for k, v in env.items() if "${{" not in str(v)}


def run_step(name: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """A workflow step as GitHub runs it (bash -e, the job's environment), with this interpreter's ``detinfer``
    first on PATH."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    return run(["bash", "-eo", "pipefail", "-c", workflow_step(name)], cwd,
               **{"PATH": path, "DETINFER_MODEL": "smollm2-135m-instruct-q4_1"} | workflow_env() | env)  # fmt: skip


def test_the_workflow_cache_key_step(tmp_path: Path, monkeypatch):
    """The step writes ``key=`` + the key of the model the workflow names, for its compile target's level (not
    this CPU), to $GITHUB_OUTPUT."""
    from detinfer.integrations.ci_report import cache_key

    output = tmp_path / "github_output"
    r = run_step("Cache key", tmp_path, GITHUB_OUTPUT=str(output))
    assert r.returncode == 0, r.stdout + r.stderr
    monkeypatch.setenv("DETINFER_CPU_LEVEL", workflow_env()["DETINFER_CPU_LEVEL"])
    assert output.read_text() == f"key={cache_key('smollm2-135m-instruct-q4_1')}\n" and output.read_text().endswith("-x86-64-v3\n")


def _cache_files(jit: Path) -> set[Path]:
    return {p for p in jit.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def level_jit(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, set[Path]]:
    """An empty JIT cache filled by the workflow's warm-up step (for its level), and the files it holds then."""
    if host_level() not in ("x86-64-v3", "x86-64-v4"):
        pytest.skip("needs an x86-64-v3 CPU")
    jit = tmp_path_factory.mktemp("level-jit")
    r = run_step("Compile the kernels", jit, NUMBA_CACHE_DIR=str(jit))
    assert r.returncode == 0 and "(target x86-64-v3)" in r.stdout, r.stdout + r.stderr
    return jit, _cache_files(jit)


def test_the_workflow_verify_step_runs_what_exists(tmp_path: Path, level_jit: tuple[Path, set[Path]]):
    """With neither manifests/ nor sessions/ the step says so and passes; with manifests/ alone it verifies those
    (the control: the same step does run verify, whose report lists each manifest), loading every kernel from
    the warm-up step's cache: it adds no file there (test_warm_up's control shows another target would)."""
    jit, kept = level_jit
    bare = tmp_path / "bare"
    bare.mkdir()
    r = run_step("Manifests and session records", bare, NUMBA_CACHE_DIR=str(jit))
    assert r.returncode == 0 and "nothing for detinfer verify" in r.stdout, r.stdout + r.stderr
    assert not (bare / "verify.xml").exists()

    some = tmp_path / "some"
    shutil.copytree(EXAMPLE / "manifests", some / "manifests")
    r = run_step("Manifests and session records", some, NUMBA_NUM_THREADS="1", NUMBA_CACHE_DIR=str(jit))
    assert r.returncode == 0 and "nothing for" not in r.stdout, r.stdout + r.stderr
    suite = ET.parse(some / "verify.xml").getroot().find("testsuite")
    assert suite.get("tests") == str(len(list((EXAMPLE / "manifests").glob("*.json")))) and suite.get("failures") == "0"
    assert kept and _cache_files(jit) == kept

"""The Python API, which the CLI and the server are built on: load a model and run it (llm.py), re-execute records
(records.py), download and describe models (models.py).

Modelled on llama-cpp-python's ``Llama``::

    import detinfer
    llm = detinfer.load()                       # the registry's default model, n_ctx 4096, f32 KV cache
    run = llm.chat([{"role": "user", "content": "Hi"}], max_tokens=16)
    run.text, run.tokens, run.stop_reason       # str, list[int], "eos" | "stop" | "stop_cut" | "max_tokens" | "length"
    run.manifest.save("run.json")               # the run manifest; `detinfer verify run.json` re-executes it

Every call is a pure function of the model file, the prompt and the sampling options: the same call gives the
same tokens, text and logits, bit for bit, at any thread count. Errors are :class:`detinfer.errors.DetinferError`
subclasses with a one-line message (InputError for a bad option or prompt, GGUFError for a bad model file, ...).
"""

from ..compute.constrain import Constraint
from ..compute.generate import Step
from ..compute.sampling import Sampling
from ..compute.speculate import SPECULATORS, check_speculate
from .llm import (
    LLM,
    PROGRESS_MARK,
    Conversation,
    Result,
    SessionResult,
    Stream,
    check_chunk_size,
    constraint_from_options,
    load,
    load_messages,
    read_prompt_file,
    set_threads,
)
from .models import DEFAULT_MODEL, ModelInfo, WarmUp, jit_cache_files, list_models, model_info, pull, warm_up
from .records import (
    BAD_INPUT,
    DEFAULT_BATCH,
    MATCH,
    MISMATCH,
    Outcome,
    ReplayOptions,
    VerifyResult,
    branch,
    collect,
    collect_sessions,
    describe_machine,
    exit_code,
    inspect_kv,
    load_script,
    read_all,
    replay,
    rerun,
    selftest,
    selftest_ok,
    short_machine,
    summary,
    to_json_lines,
    verify,
)

__all__ = ["BAD_INPUT", "DEFAULT_BATCH", "Constraint", "Conversation", "DEFAULT_MODEL", "LLM", "MATCH", "MISMATCH", "ModelInfo", "Outcome",
           "PROGRESS_MARK", "ReplayOptions", "Result", "SPECULATORS", "Sampling", "SessionResult", "Step", "Stream", "VerifyResult", "WarmUp", "branch",
           "check_chunk_size", "check_speculate",
           "collect", "collect_sessions", "constraint_from_options", "describe_machine", "exit_code", "inspect_kv", "jit_cache_files",
           "list_models", "load", "load_messages", "load_script", "model_info", "pull", "read_all", "read_prompt_file", "replay",
           "rerun", "selftest", "selftest_ok", "set_threads", "short_machine", "summary", "to_json_lines", "verify", "warm_up"]

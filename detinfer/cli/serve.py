"""``detinfer serve``: the OpenAI-compatible server (serve/) on one model."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from .. import api
from ..errors import DetinferError
from .common import (
    DEFAULT_CACHE_BYTES,
    CacheBytesOpt,
    ChatTemplateOpt,
    CtxOpt,
    KvOpt,
    ModelOpt,
    SpeculateOpt,
    ThreadsOpt,
    app,
    check_outputs,
    compiling,
    err,
    fail,
)


@app.command()
def serve(
    model: ModelOpt = None,
    port: Annotated[int, typer.Option("--port", help="TCP port.")] = 8080,
    host: Annotated[str, typer.Option("--host", help="Bind address (default loopback only).")] = "127.0.0.1",
    max_queue: Annotated[int, typer.Option("--max-queue", min=1, help="Requests admitted at once; more get 429.")] = 8,
    max_inflight: Annotated[int, typer.Option("--max-inflight", min=1, help="Requests preparing (template, tokenize) at once.")] = 4,
    ctx: CtxOpt = 4096,
    kv_type: KvOpt = "f32",
    threads: ThreadsOpt = None,
    speculate: SpeculateOpt = None,
    batch: Annotated[int, typer.Option("--batch", min=1, help="Requests the decode worker steps together (continuous batching). Never changes a result.")] = api.DEFAULT_BATCH,
    cache_bytes: CacheBytesOpt = DEFAULT_CACHE_BYTES,
    record_dir: Annotated[Optional[Path], typer.Option("--record", help="Record every request into session files in this directory.")] = None,
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar="DETINFER_API_KEY", show_envvar=True,
                                                   help="Require Authorization: Bearer KEY on every request.")] = None,
    send_timeout: Annotated[float, typer.Option("--send-timeout", min=0.1, help="Drop a streaming client that reads nothing for this many seconds.")] = 30.0,
    chat_template: ChatTemplateOpt = None,
    drain: Annotated[float, typer.Option("--drain", min=0.0, help="On SIGTERM, seconds running requests may finish before they are cancelled.")] = 5.0,
    read_timeout: Annotated[float, typer.Option("--read-timeout", min=0.1, help="Seconds a client has to send a request's headers, and then its body.")] = 10.0,
    alias: Annotated[Optional[list[str]], typer.Option("--alias", help="Another name a request's model may give (repeatable); others are a 404.")] = None,
    kv_dir: Annotated[Optional[Path], typer.Option("--kv-dir", help="Keep the prefix cache's KV snapshots in this folder too (.detkv): a restarted server is warm.")] = None,
    kv_dir_bytes: Annotated[int, typer.Option("--kv-dir-bytes", min=0, help="Byte budget of this model's files in --kv-dir (oldest deleted first).")] = 4 << 30,
) -> None:
    """OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions, /v1/responses, /v1/models, /health)."""
    from ..serve import listen  # FastAPI and uvicorn: a fifth of every other command's start, so imported here only
    from ..serve.app import create_app
    from ..serve.serving import ServerSettings

    try:
        check_outputs({}, {"--record": record_dir, "--kv-dir": kv_dir})
        sock = listen.bind(host, port)
        llm = api.load(model, n_ctx=ctx, kv_type=kv_type, threads=threads, chat_template=chat_template, speculate=speculate)  # the decode worker sets the threads on its own thread
        engine = llm.engine
        settings = ServerSettings(max_queue=max_queue, max_inflight=max_inflight, threads=threads, cache_bytes=cache_bytes,
                                  record_dir=record_dir, api_key=api_key or None, send_timeout=send_timeout,
                                  chat_template=llm.chat_template, drain_s=drain, body_timeout=read_timeout,
                                  aliases=tuple(alias or ()), kv_dir=kv_dir, kv_dir_bytes=kv_dir_bytes, speculate=speculate,
                                  batch=batch)
        app_ = create_app(engine, settings)
        compiling(app_.state.server.worker.warm_up)  # on the decode thread, which runs every forward pass
    except DetinferError as e:
        fail(e)
    err.print(f"serving {escape(str(engine.model_file.path.name))} on http://{host}:{port}/v1"
              + (" (API key required)" if api_key else ""))
    listen.serve(app_, sock, drain_s=drain, header_timeout=read_timeout)

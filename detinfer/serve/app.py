"""The FastAPI app: authentication, errors in OpenAI's shape, and one route per endpoint, each a thin call into
its module (chat_completions.py, completions.py, responses.py) through the shared serving machinery."""

from __future__ import annotations

import hmac
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..compute.engine import Engine
from ..errors import DetinferError
from ..version import __version__
from .chat_completions import ChatCompletions
from .completions import Completions
from .protocol import ApiError, ChatRequest, CompletionRequest, parse, read_json
from .responses import Responses
from .serving import Server, ServerSettings, respond


def create_app(engine: Engine, settings: ServerSettings = ServerSettings()) -> FastAPI:
    """The FastAPI app serving ``engine``; the decode worker starts and stops with the app's lifespan."""
    server = Server(engine, settings)
    chat, completions = ChatCompletions(server), Completions(server)
    responses = Responses(server, chat)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.start()
        yield
        server.stop()

    app = FastAPI(title="detinfer", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server

    async def body(request: Request) -> dict:
        return await read_json(request, settings.max_body_bytes, settings.body_timeout)

    @app.middleware("http")
    async def auth(request: Request, call_next):
        if settings.api_key is not None:
            header = request.headers.get("authorization", "").encode("latin-1")  # the header's raw bytes
            given = header[7:] if header[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(given, settings.api_key.encode("utf-8")):
                return ApiError(401, "missing or invalid API key (Authorization: Bearer KEY)", code="invalid_api_key").response()
        return await call_next(request)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return e.response()

    @app.exception_handler(DetinferError)
    async def detinfer_error(request: Request, e: DetinferError):
        # what a request can raise (a template's raise_exception, text that cannot be tokenized) is about its values
        return ApiError(400, str(e), code="invalid_value").response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):  # 404, 405...: OpenAI's shape, not {"detail"}
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        message = f"{request.method} {request.url.path}: {e.detail}"
        return ApiError(e.status_code, message, code=code, headers=getattr(e, "headers", None)).response()

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": server.model_id, "admitted": server.admitted, "max_queue": settings.max_queue}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "detinfer"} for name in server.names]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await respond(server, request, parse(ChatRequest, await body(request)), chat)

    @app.post("/v1/completions")
    async def text_completions(request: Request):
        return await respond(server, request, parse(CompletionRequest, await body(request)), completions)

    @app.post("/v1/responses")
    async def responses_(request: Request):
        return await responses.serve(request, await body(request))

    return app

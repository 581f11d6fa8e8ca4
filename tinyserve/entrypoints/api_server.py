"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) and the ``tinyserve serve`` command.

``build_app(async_engine, server_config)`` wires routes to an AsyncEngine (tests pass their
own); ``create_app(engine_args, server_config)`` loads the model first; ``run_server(ns)`` is
the CLI entry. Server state lives on ``app.state``; nothing is global.

With an API key (``--api-key`` or $TINYSERVE_API_KEY) every path needs
``Authorization: Bearer <key>`` (http_guards.APIKeyGuard: the /v1 routes, /tokenize,
/detokenize, /metrics, the engine view, /openapi.json, /docs, unknown paths) except those the
operator leaves open: ``--open-routes`` (default /health and the playground's static files)
and ``--metrics-no-key``. Bodies over ``--max-request-bytes`` get 413 before they are read.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
from contextlib import asynccontextmanager
from types import FrameType

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import JSONResponse, Response

from tinyserve.config import ServerConfig
from tinyserve.engine.arg_utils import EngineArgs, add_engine_args
from tinyserve.engine.async_engine import AsyncEngine
from tinyserve.entrypoints import protocol as P
from tinyserve.entrypoints import serving_tokens as TK
from tinyserve.entrypoints.engine_events import engine_events_router
from tinyserve.entrypoints.http_guards import (
    APIKeyGuard,
    BodySizeLimit,
    check_api_key,
    install_error_handlers,
)
from tinyserve.entrypoints.metrics import CONTENT_TYPE, ServerMetrics
from tinyserve.entrypoints.playground import playground_router
from tinyserve.entrypoints.protocol import OpenAIError
from tinyserve.entrypoints.serving_chat import ChatServing
from tinyserve.entrypoints.serving_completion import CompletionServing
from tinyserve.entrypoints.serving_messages import MessagesServing, messages_router
from tinyserve.entrypoints.serving_responses import ResponsesServing, responses_router
from tinyserve.entrypoints.serving_tokens import TokenizeServing
from tinyserve.entrypoints.streaming import DRAIN_MARGIN_S, input_size, off_loop
from tinyserve.utils.memory import cap_arenas

logger = logging.getLogger(__name__)

API_KEY_ENV = "TINYSERVE_API_KEY"
_ERRORS = {
    400: {"model": P.ErrorResponse, "description": "Invalid request"},
    401: {"model": P.ErrorResponse, "description": "Missing or wrong API key"},
    404: {"model": P.ErrorResponse, "description": "Unknown model"},
    429: {"model": P.ErrorResponse, "description": "Waiting queue full"},
    503: {"model": P.ErrorResponse, "description": "Engine not running"},
}


def _router() -> APIRouter:
    api = APIRouter(dependencies=[Depends(check_api_key)], responses=_ERRORS)

    @api.post("/v1/chat/completions", response_model=P.ChatCompletionResponse)
    async def chat_completions(body: P.ChatCompletionRequest, request: Request) -> Response:
        """Chat completion; `stream: true` answers with `text/event-stream` chunks."""
        return await request.app.state.serving_chat.create(body, request)

    @api.post("/v1/completions", response_model=P.CompletionResponse)
    async def completions(body: P.CompletionRequest, request: Request) -> Response:
        """Text completion; `stream: true` answers with `text/event-stream` chunks."""
        return await request.app.state.serving_completion.create(body, request)

    def card(state) -> P.ModelCard:
        return P.ModelCard(id=state.model_name, root=state.model_root,
                           max_model_len=state.async_engine.max_model_len)  # fmt: skip

    @api.get("/v1/models", response_model=P.ModelList)
    async def models(request: Request) -> P.ModelList:
        return P.ModelList(data=[card(request.app.state)])

    @api.get("/v1/models/{model_id:path}", response_model=P.ModelCard)
    async def model(model_id: str, request: Request) -> P.ModelCard:
        """OpenAI's retrieve (``client.models.retrieve``): the served model, else a 404."""
        request.app.state.serving_chat.check_model(model_id)
        return card(request.app.state)

    @api.post("/tokenize", response_model=TK.TokenizeResponse)
    async def tokenize(body: TK.TokenizeRequest, request: Request) -> TK.TokenizeResponse:
        size = input_size([body.prompt, body.messages, body.tools])  # large: off the loop
        return await off_loop(size, request.app.state.serving_tokens.tokenize, body)

    @api.post("/detokenize", response_model=TK.DetokenizeResponse)
    async def detokenize(body: TK.DetokenizeRequest, request: Request) -> TK.DetokenizeResponse:
        size = 4 * len(body.tokens)  # ~characters
        return await off_loop(size, request.app.state.serving_tokens.detokenize, body)

    # The OpenAPI document and its viewer sit behind the key too (FastAPI's own are off).
    @api.get("/openapi.json", include_in_schema=False)
    async def openapi(request: Request) -> JSONResponse:
        return JSONResponse(request.app.openapi())

    @api.get("/docs", include_in_schema=False)
    async def docs(request: Request) -> Response:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="tinyserve API")

    return api


def _monitoring_router() -> APIRouter:
    """/health and /metrics: behind the key like every route unless --open-routes /
    --metrics-no-key leave them open (APIKeyGuard; /health is open by default)."""
    api = APIRouter()

    @api.get("/metrics", response_class=Response)
    async def metrics(request: Request) -> Response:
        return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE)

    @api.get("/health", responses={503: {"model": P.ErrorResponse}})
    async def health(request: Request) -> Response:
        engine: AsyncEngine = request.app.state.async_engine
        if engine.is_healthy:
            return Response(status_code=200)
        reason = engine.dead_reason or "the engine is not running"
        return OpenAIError(503, reason, "service_unavailable_error", code="engine_dead").response()

    return api


def build_app(async_engine: AsyncEngine, server_config: ServerConfig | None = None) -> FastAPI:
    """The FastAPI app around an AsyncEngine. The engine thread starts with the app's
    lifespan (on the server's event loop) and stops with it."""
    config = server_config or ServerConfig()
    info = async_engine.info
    model_name = config.served_model_name or info.model_name
    metrics = ServerMetrics(model_name)
    metrics.attach(async_engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        logger.info(
            "serving %s at http://%s:%d (KV cache %s tokens, max_model_len %d); "
            "playground at http://%s:%d/",
            model_name,
            config.host,
            config.port,
            info.kv_capacity_tokens,
            info.max_model_len,
            config.host,
            config.port,
        )
        yield
        async_engine.shutdown()

    app = FastAPI(
        title="tinyserve",
        summary="OpenAI-compatible inference server",
        version="0.1.0",
        lifespan=lifespan,
        openapi_url=None,  # served by _router(), behind the API key
        docs_url=None,
        redoc_url=None,
    )
    app.state.async_engine = async_engine
    # One handler per API over the shared steps (serving.py).
    common = (async_engine, model_name, config.shutdown_timeout, config.log_requests,
              config.open_tool_arguments, config.reasoning_parser, config.json_pretty)  # fmt: skip
    app.state.model_name = model_name
    app.state.serving_chat = ChatServing(*common)
    app.state.serving_completion = CompletionServing(*common)
    app.state.serving_responses = ResponsesServing(*common)
    app.state.serving_messages = MessagesServing(*common)
    app.state.serving_tokens = TokenizeServing(*common)
    app.state.metrics = metrics
    app.state.api_key = config.api_key
    app.state.max_request_bytes = config.max_request_bytes
    app.state.model_root = info.model_path or model_name
    app.include_router(_router())
    app.include_router(responses_router())
    app.include_router(messages_router())
    app.include_router(engine_events_router())
    app.include_router(_monitoring_router())
    app.include_router(playground_router())
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=config.max_request_bytes)
    # Added last, so it runs first: a request without the key is refused before its body.
    app.add_middleware(APIKeyGuard, api_key=config.api_key, open_routes=config.routes_without_key)
    return app


def create_app(
    engine_args: EngineArgs | None = None, server_config: ServerConfig | None = None
) -> FastAPI:
    """Load the model (slow) and build the app."""
    from tinyserve.engine.llm_engine import LLMEngine

    config = server_config or ServerConfig()
    engine = LLMEngine(engine_args or EngineArgs())
    return build_app(AsyncEngine(engine, config.max_queued_requests), config)


# -- the `tinyserve serve` command --------------------------------------------------------------


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    d = ServerConfig()
    p = subparsers.add_parser(
        "serve",
        help="start the OpenAI-compatible HTTP server",
        description="Serve a model over an OpenAI-compatible HTTP API (flags as `vllm serve`).",
    )
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=_port, default=d.port)
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients send (default: the model's)",
    )
    _add_key_args(p)
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=d.max_queued_requests,
        help="requests allowed to wait beyond --max-num-seqs before answering 429",
    )
    p.add_argument(
        "--log-requests",
        action="store_true",
        help="log each request's body (prompts included); off by default",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=d.max_request_bytes,
        help="refuse request bodies larger than this with 413",
    )
    _add_output_args(p)
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=d.shutdown_timeout,
        help="on SIGTERM, seconds to let in-flight requests finish before exiting",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
    )
    add_engine_args(p)
    p.set_defaults(func=run_server)
    return p


def _add_output_args(p: argparse.ArgumentParser) -> None:
    """How answers are shaped: tool arguments, JSON's layout, thinking blocks."""
    p.add_argument(
        "--open-tool-arguments",
        action="store_true",
        help="let tool-call arguments hold properties their schema does not declare (by "
        "default OpenAI's strict semantics: an object with properties takes only those, "
        "unless its schema sets additionalProperties)",
    )
    p.add_argument(
        "--json-pretty",
        action="store_true",
        help="let structured-output JSON be pretty-printed, within bounds (at most one newline "
        "and 40 spaces between tokens), where a request names no layout; by default it is "
        "written on one line (', ' and ': ', no other whitespace)",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=("auto", "think", "none"),
        default="auto",
        help="chat answers' <think>...</think> block goes to message.reasoning_content: auto "
        "(where the chat template has <think>: Qwen3, SmolLM3), think (always), none",
    )


def _add_key_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but those --open-routes "
        f"names (default: ${API_KEY_ENV})",
    )
    p.add_argument(
        "--open-routes",
        type=_route_list,
        default=None,
        help="with --api-key, the comma-separated paths that answer without it (exact, or "
        "'/folder/*'); default: /health,/,/playground/* (the probe and the playground's static "
        "files). Every other route needs the key",
    )
    p.add_argument(
        "--metrics-no-key",
        action="store_true",
        help="with --api-key, leave /metrics open for a scraper (it needs the key by default)",
    )
    p.add_argument(
        "--metrics-require-key",
        action="store_true",
        help=argparse.SUPPRESS,  # the default since issue 37; accepted for old command lines
    )


def _port(text: str) -> int:
    """A TCP port (0: any free one): out of range was told only after the model loaded."""
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 0-65535, got {port}")
    return port


def _route_list(text: str) -> tuple[str, ...]:
    return tuple(r.strip() for r in text.split(",") if r.strip())


def server_config_from_namespace(ns: argparse.Namespace) -> ServerConfig:
    names = {f.name for f in dataclasses.fields(ServerConfig)}
    values = {k: v for k, v in vars(ns).items() if k in names and v is not None}
    if not values.get("api_key"):
        values["api_key"] = os.environ.get(API_KEY_ENV) or None
    return ServerConfig(**values)


class _DrainingServer(uvicorn.Server):
    """On SIGTERM/SIGINT, drain and then return from ``run()``, so the command exits 0.

    uvicorn's own ``handle_exit`` also records the signal and re-raises it once the graceful
    shutdown is over (the process would die of it). This one, installed by uvicorn as the
    handler of the same signals, only sets the public ``should_exit`` / ``force_exit`` flags
    as uvicorn's does (a second Ctrl+C forces the exit), and touches no private state."""

    def __init__(self, config: uvicorn.Config, async_engine: AsyncEngine | None = None,
                 drain_s: float = 0.0) -> None:  # fmt: skip
        super().__init__(config)
        self.async_engine, self.drain_s = async_engine, drain_s

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        """uvicorn's drain, with the requests still running at ``drain_s`` ended first: each
        stream gets an error event and its end, each waiting answer a 503, so that uvicorn's
        own cut (``DRAIN_MARGIN_S`` later) finds nothing open. Cut by it they ended with no
        finish and no error (a client could not tell the answer was short) or a plain 500."""
        if self.async_engine is None:
            return await super().shutdown(sockets)
        reason = f"the server is shutting down (its drain time, {self.drain_s:g} s, ran out)"
        cut = asyncio.get_running_loop().call_later(
            self.drain_s, lambda: self.async_engine.shutdown(0.0, reason)
        )
        try:
            await super().shutdown(sockets)
        finally:
            cut.cancel()


def run_server(ns: argparse.Namespace) -> int:
    # MKL's own worker threads (torch's small matmuls, e.g. decode attention) spin between
    # calls and fight the engine's other threads and the event loop for the cores: served
    # single-stream TPOT of SmolLM2 here 51 -> 30 ms with one MKL thread, throughput at 32
    # concurrent unchanged (docs/architecture.md). Set before MKL initialises; a user's
    # MKL_NUM_THREADS wins. torch.set_num_threads() does not reach these threads.
    os.environ.setdefault("MKL_NUM_THREADS", "1")
    # Four malloc arenas, not glibc's 8 per core: fewer half-empty heaps left by the grammar
    # compile threads (utils/memory.py; issue 37's soak). A user's MALLOC_ARENA_MAX wins.
    cap_arenas(4)
    try:  # a bad setting (a flag, a device, a model) is one line, not a traceback
        config = server_config_from_namespace(ns)
        app = create_app(EngineArgs.from_namespace(ns), config)
    except (ValueError, OSError, RuntimeError) as e:  # (torch's bad device, mmap's no memory)
        logger.debug("start-up failed", exc_info=True)
        raise SystemExit(f"tinyserve serve: {e}") from None
    log_level = str(getattr(ns, "log_level", "info")).lower()
    if not logging.getLogger().handlers:  # called without cli.main's logging set-up
        logging.basicConfig(level=log_level.upper() if log_level != "trace" else "DEBUG")
    # On SIGTERM uvicorn stops accepting connections and waits (up to the timeout) for the
    # in-flight requests; the lifespan then stops the engine thread and the process exits 0.
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=log_level,
        timeout_graceful_shutdown=config.shutdown_timeout + DRAIN_MARGIN_S,
    )
    _DrainingServer(uv_config, app.state.async_engine, config.shutdown_timeout).run()
    return 0

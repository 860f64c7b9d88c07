"""The OpenAI-compatible HTTP front end: FastAPI + uvicorn in this process, the engine in another.

`moe serve MODEL` builds the app with `build_app(ServerArgs(...))` and runs it with uvicorn. At start-up
the lifespan spawns the engine process (server/frontend/engine_client.py), waits for it to load the model, then
warms it up with one tiny generation in the background; /ready answers 200 once that is done. With
`frontend_address` (`moe serve --frontend-only`) it spawns nothing: it listens there for engine jobs, answers
503 with Retry-After until one attaches (and whenever none is attached: /health says why), and requests in
flight when a job is lost continue on the next one (docs/reliability.md).

Routes: /v1/completions, /v1/chat/completions, /v1/models, /v1/expert_load, /health, /ready, /version,
/metrics, and SGLang's /start_expert_distribution_record, /stop_expert_distribution_record,
/dump_expert_distribution_record. Every error is an OpenAI error body (server/frontend/protocol.py); request
validation errors are 400 (not FastAPI's 422). With an API key, /v1/* and the record routes need
`Authorization: Bearer KEY`.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import sys
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, disable_created_metrics, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from moe_serve.server.frontend import anthropic
from moe_serve.server.frontend.engine_client import EngineClient, EngineFailure, Sink
from moe_serve.server.frontend.metrics import Metrics
from moe_serve.server.frontend.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                       TokenizeRequest, error_body)
from moe_serve.server.core.sampling_params import SamplingParams
from moe_serve.server.frontend.serving import OpenAIServing
from moe_serve.server.core.startup import freeze_startup_heap, since_process_start, summary

log = logging.getLogger(__name__)

RETRY_AFTER_DETACHED_S = 2  # the Retry-After of a 503 while no engine is attached
RECORD_ROUTES = ("/start_expert_distribution_record", "/stop_expert_distribution_record",
                 "/dump_expert_distribution_record")


@dataclass
class ServerArgs:
    engine_kwargs: dict  # EngineConfig fields, model included
    served_model_names: list[str] = field(default_factory=list)
    api_key: str | None = None
    heartbeat_timeout_s: float = 30.0
    log_level: int = logging.WARNING
    max_waiting_requests: int = 256  # engine requests in flight beyond max_num_seqs x DP ranks; then 503
    frontend_address: str | None = None  # tcp://HOST:PORT: the front end alone; engine jobs attach there
    frontend_secret: str | None = None  # what attaching engines must present (required beyond loopback)
    reattach_timeout_s: float = 300.0  # detached this long: requests in flight fail with 503


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("moe-serve")
    except PackageNotFoundError:
        return "unknown"


class APIKeyMiddleware:
    """Pure ASGI (streaming and disconnect detection pass through untouched); constant-time compare."""

    def __init__(self, app, api_key: str):
        self.app, self.expected, self.key = app, f"Bearer {api_key}".encode(), api_key.encode()

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        protected = path.startswith("/v1") or path in RECORD_ROUTES
        if scope["type"] == "http" and scope.get("method") != "OPTIONS" and protected:
            headers = dict(scope.get("headers") or [])
            auth = headers.get(b"authorization", b"")
            anthropic_key = headers.get(b"x-api-key")  # how Anthropic's clients send it (/v1/messages)
            ok = hmac.compare_digest(auth, self.expected) or (
                anthropic_key is not None and hmac.compare_digest(anthropic_key, self.key))
            if not ok:
                await JSONResponse(error_body("invalid or missing API key: send 'Authorization: Bearer <key>'", 401),
                                   status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(args: ServerArgs) -> FastAPI:
    disable_created_metrics()  # no *_created series next to every counter and histogram
    model = args.engine_kwargs["model"]
    names = args.served_model_names or [model]
    metrics = Metrics()
    state: dict = {"ready": False}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state["startup"] = {"frontend_import": since_process_start()}
        client = EngineClient(args.engine_kwargs, metrics, args.heartbeat_timeout_s, args.log_level,
                              secret=args.frontend_secret, reattach_timeout_s=args.reattach_timeout_s)
        state["client"], state["serving"], tasks = client, None, []

        def on_attach(info: dict) -> None:
            """Size the API from the engine that has just attached; warm the first one up."""
            if state["tokenizer"] is None:  # attached while the tokenizer loads: sized right after it
                state["early_attach"] = info
                return
            max_in_flight = info.get("max_num_seqs", 64) * info.get("data_parallel_size", 1) + args.max_waiting_requests
            serving = state["serving"]
            if serving is None:
                state["startup"].update(info.get("startup", {}))
                state["serving"] = OpenAIServing(client, state["tokenizer"], names, info["max_model_len"],
                                                 info["vocab_size"], max_in_flight)
                tasks.append(asyncio.create_task(_warm_up(client, state["tokenizer"], state, metrics)))
            else:
                serving.max_model_len, serving.vocab_size = info["max_model_len"], info["vocab_size"]
                serving.max_in_flight = max_in_flight

        client.on_attach.append(on_attach)
        try:
            state["tokenizer"] = None
            if args.frontend_address:
                client.listen(args.frontend_address)
            else:
                client.spawn()  # the engine loads the model while this process loads the tokenizer
            state["tokenizer"] = await asyncio.get_running_loop().run_in_executor(None, _load_tokenizer, model)
            if "early_attach" in state:
                on_attach(state.pop("early_attach"))
            if not args.frontend_address:
                await client.wait_ready()
        except BaseException:
            await client.close()
            raise
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await client.close()

    app = FastAPI(title="moe-serve", version=_version(), lifespan=lifespan)
    if args.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=args.api_key)

    def serving() -> OpenAIServing:
        if state["serving"] is None:  # no engine yet, or the first one attached while the tokenizer loads
            client()
            raise APIError("starting up", status=503, headers={"Retry-After": str(RETRY_AFTER_DETACHED_S)})
        return state["serving"]

    def client() -> EngineClient:
        c = state["client"]
        if not c.alive:
            why = c.why_not_alive() if c.dead_reason or not c.attached else "no heartbeat"
            raise APIError(f"the engine is not running ({why})", status=503,
                           headers={"Retry-After": str(RETRY_AFTER_DETACHED_S)})
        return c

    # ---- errors -----------------------------------------------------------------------------------
    def _error(request: Request, message: str, status: int, param: str | None = None,
               headers: dict | None = None) -> JSONResponse:
        """OpenAI's error body, or Anthropic's on /v1/messages (each client parses its own)."""
        body = anthropic.error_body(message, status) if request.url.path.startswith("/v1/messages") else \
            error_body(message, status, param)
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return _error(request, exc.message, exc.status, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        err = (exc.errors() or [{}])[0]
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        if err.get("type") == "json_invalid":
            return _error(request, f"the request body is not valid JSON: {err.get('msg', '')}", 400)
        param = loc[0] if loc else None
        where = ".".join(loc) or "body"
        return _error(request, f"{where}: {err.get('msg', 'invalid value')}", 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return _error(request, str(exc.detail), exc.status_code)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return _error(request, f"internal error: {type(exc).__name__}: {exc}", 500)

    # ---- OpenAI routes ----------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        client()
        return await serving().completions(body, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        client()
        return await serving().chat(body, raw)

    @app.post("/v1/messages")
    async def anthropic_messages(body: anthropic.MessagesRequest, raw: Request):
        client()
        return await anthropic.messages(serving(), body, raw)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        return serving().tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return serving().detokenize(body)

    @app.get("/v1/models")
    async def models():
        info = state["client"].info
        return {"object": "list", "data": [{"id": n, "object": "model", "created": 0, "owned_by": "moe-serve",
                                            "root": model, "max_model_len": info.get("max_model_len")} for n in names]}

    # ---- health, metrics --------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        """200 {"engine_generation": engines attached so far, "requests_in_flight"} while an engine is attached;
        503 with why not (none attached yet, the job lost and waiting to re-attach, restarts exhausted)."""
        c = client()
        return {"engine_generation": c.generation, "requests_in_flight": len(c.sinks)}

    @app.get("/ready")
    async def ready():
        client()
        if not state["ready"]:
            raise APIError("warming up", status=503)
        return {"ready": True}

    @app.get("/version")
    async def version():
        return {"version": _version()}

    @app.get("/metrics")
    async def metrics_route():
        c = state["client"]
        if c.alive:
            try:
                metrics.engine.update(await c.call("stats", timeout_s=5.0), alive=True)
            except Exception as exc:  # noqa: BLE001 - scrape with the last values rather than fail
                log.warning("engine stats unavailable: %s", exc)
        else:
            metrics.engine.engine_alive = False
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # ---- expert load ------------------------------------------------------------------------------
    async def expert_load(op: str) -> dict:
        try:
            return await client().call("expert_load", op=op)
        except ValueError as exc:
            raise APIError(str(exc), param="expert_load") from None

    @app.get("/v1/expert_load")
    async def get_expert_load(view: str = "window"):
        if view not in ("window", "total", "record"):
            raise APIError(f"view must be window, total or record, got {view!r}", param="view")
        return await expert_load(view)

    @app.post("/start_expert_distribution_record")
    async def start_record():
        return await expert_load("start")

    @app.post("/stop_expert_distribution_record")
    async def stop_record():
        return await expert_load("stop")

    @app.post("/dump_expert_distribution_record")
    async def dump_record():
        return await expert_load("record")

    return app


def _load_tokenizer(model: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


async def _warm_up(client: EngineClient, tokenizer, state: dict, metrics: Metrics) -> None:
    """One tiny greedy generation through the whole path; then /ready answers 200 and the start-up phases
    are logged and exported (moe_startup_seconds)."""
    t0 = time.perf_counter()
    queue: asyncio.Queue = asyncio.Queue()
    ids = tokenizer.encode("warm up")
    client.add("warmup", ids, SamplingParams(max_tokens=2, temperature=0.0),
               Sink(queue, 0, len(ids), track_metrics=False))
    while True:
        _, out = await queue.get()
        if isinstance(out, EngineFailure):
            log.error("warm-up failed: %s", out.message)
            return
        if out.finished:
            break
    try:  # the warm-up's routing is not load: the expert-load statistics start after it
        await client.call("expert_load", op="reset")
    except ValueError:
        pass  # a model without MoE layers records nothing
    phases = {**state.get("startup", {}), "warmup": time.perf_counter() - t0, "total": since_process_start()}
    for phase, seconds in phases.items():
        metrics.startup.labels(phase).set(seconds)
    freeze_startup_heap()  # (the front end's start-up objects: FastAPI, the tokenizer)
    state["ready"] = True
    log.info("warm-up done; ready")
    print(f"moe serve: ready; start-up {summary(phases)}", file=sys.stderr, flush=True)


def run_server(args: ServerArgs, host: str, port: int) -> None:
    import uvicorn

    uvicorn.run(build_app(args), host=host, port=port, log_level=logging.getLevelName(args.log_level).lower(),
                timeout_keep_alive=5)

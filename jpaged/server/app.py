"""The FastAPI app (OpenAI-compatible routes, /health, /metrics) and uvicorn runners."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import uvicorn
from fastapi import APIRouter, FastAPI, Query
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from jpaged import __version__
from jpaged.async_engine import AsyncLLMEngine, EngineDeadError, RequestFailedError
from jpaged.config import DEFAULT_HOST, DEFAULT_MAX_STORED_RESPONSES, DEFAULT_PORT
from jpaged.engine import LLMEngine
from jpaged.frontend import RequestFrontend
from jpaged.gc_heap import freeze_gc_heap
from jpaged.lora_request import LoRARequest
from jpaged.metrics import render, with_labels
from jpaged.server.completions import CompletionServing
from jpaged.server.embeddings import pooling_only_error
from jpaged.server.lora_modules import parse_lora_modules, runtime_updating_allowed
from jpaged.server.protocol import (
    SCORE_SIDES,
    ChatCompletionRequest,
    ClassificationRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoRAAdapterRequest,
    OpenAIError,
    RerankRequest,
    ScoreRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
    error_body,
)
from jpaged.server.reasoning_parsers import get_reasoning_parser
from jpaged.server.request_log import RequestLogger
from jpaged.server.responses import ResponsesServing, ResponseStore
from jpaged.server.responses_protocol import ResponsesRequest
from jpaged.server.scoring import ScoreServing
from jpaged.server.serving import EventStream, load_chat_template
from jpaged.server.tokenization import TokenizationServing
from jpaged.server.tool_parsers import auto_tool_parser

if TYPE_CHECKING:
    from jpaged.dp.client import DPEngineClient

logger = logging.getLogger("jpaged.server")


class _Serving(CompletionServing, ResponsesServing, TokenizationServing, ScoreServing):
    """The generation, embedding, score and tokenizer endpoints over one engine (its tokenizer
    measured once)."""


class _EventStreamResponse(StreamingResponse):
    """text/event-stream whose generator is closed (and requests aborted) however it ends."""

    def __init__(self, stream: EventStream, on_end: Callable[[], None] | None = None) -> None:
        super().__init__(stream.events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self._stream = stream
        self._on_end = on_end

    async def stream_response(self, send: Send) -> None:
        """Send the events; on a disconnect (cancellation) close the generator and abort."""
        try:
            await super().stream_response(send)
        finally:
            self._stream.close()  # synchronous, so it runs even while being cancelled
            if self._on_end is not None:
                self._on_end()
            await self._stream.events.aclose()  # type: ignore[attr-defined]


class _ApiKeyGate:
    """ASGI middleware: a /v1 request without `Authorization: Bearer KEY` gets its 401 before
    anything reads its body (a malformed body with a wrong key is a 401, not a 400)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.want = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # A CORS preflight (OPTIONS) carries no key: the CORS layer answers it (vLLM's rule).
        if scope["type"] == "http" and scope["path"].startswith("/v1") \
                and scope["method"] != "OPTIONS":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.want):
                err = OpenAIError(401, "Incorrect or missing API key (Authorization: Bearer KEY)",
                                  "authentication_error", code="invalid_api_key")
                await JSONResponse(err.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One line naming each bad field (its first error only), and the first field's name."""
    parts: dict[str, str] = {}
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", "")
            return f"the request body is not valid JSON ({detail})", None
        loc = [str(x) for x in err.get("loc", ()) if x not in ("body", "query")]
        parts.setdefault(loc[0] if loc else "body",
                         f"{'.'.join(loc) or 'body'}: {err.get('msg', 'invalid')}")
    param = next((k for k in parts if k != "body"), None)
    return "; ".join(parts.values()) or "invalid request body", param


def default_model_name(engine: LLMEngine | str) -> str:
    """The name a model is served under when none is given: its file or directory name."""
    name = Path(engine if isinstance(engine, str) else engine.loaded.source).name
    return name[: -len(".gguf")] if name.endswith(".gguf") else name


def build_app(engine: LLMEngine | AsyncLLMEngine | DPEngineClient,
              served_model_name: str | Sequence[str] | None = None, api_key: str | None = None,
              owned: bool | None = None, enable_tokenizer_info_endpoint: bool = False,
              enable_server_load_tracking: bool = False, enable_auto_tool_choice: bool = False,
              tool_call_parser: str | None = None, chat_template: str | None = None,
              allowed_origins: Sequence[str] = ("*",), allow_credentials: bool = False,
              max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES,
              enable_log_requests: bool = False, enable_log_outputs: bool = False,
              max_log_len: int | None = None, reasoning_parser: str | None = None,
              lora_modules: Sequence[str | dict[str, Any]] | None = None,
              allow_runtime_lora_updating: bool | None = None) -> FastAPI:
    """An OpenAI-compatible FastAPI app over `engine`: one engine (an LLMEngine is run and
    owned by the app) or data-parallel replicas (jpaged.dp.DPEngineClient).

    `served_model_name`: the name clients use, or several (vLLM's list: requests may name any;
    answers, metrics and logs carry the first).
    `owned`: shut the engine down with the app (default: only an LLMEngine it wraps itself).
    `enable_tokenizer_info_endpoint`: serve /tokenizer_info (vLLM's flag; it shows the chat
    template and special tokens, so it is off unless asked for).
    `enable_server_load_tracking`: /load counts the generation requests in flight (vLLM's
    flag; without it /load answers 0).
    `enable_auto_tool_choice` with `tool_call_parser` (one of jpaged.server.tool_parsers'):
    vLLM's tool_choice "auto", the model's own calls parsed from its text. A bad pair is a
    ValueError before anything starts.
    `chat_template`: vLLM's --chat-template, a file or the template itself, used in place of
    the model's (a request's own still wins).
    `allowed_origins`, `allow_credentials`: CORS, as vLLM's (every origin by default, so a
    browser page may call the API; its preflights pass the API key's gate).
    `max_stored_responses`: how many /v1/responses answers are kept (the newest) for
    previous_response_id, retrieval and background runs; 0 keeps none.
    `enable_log_requests`, `enable_log_outputs`, `max_log_len`: vLLM's request log (a line per
    engine request as it is added, with its prompt and parameters; one as it finishes, with
    its text; prompts, texts and id lists cut at `max_log_len`).
    `reasoning_parser`: vLLM's --reasoning-parser (jpaged.server.reasoning_parsers): a
    reasoning model's thought comes back as the message's `reasoning`, apart from its content.
    `lora_modules`: vLLM's --lora-modules, `name=path` or {"name", "path", "base_model_name"}
    entries (the engine needs enable_lora): a request whose `model` names one runs with that
    LoRA adapter; each is read and checked here, before anything starts.
    `allow_runtime_lora_updating`: serve /v1/load_lora_adapter and /v1/unload_lora_adapter
    (None: as vLLM, when VLLM_ALLOW_RUNTIME_LORA_UPDATING is true).
    """
    parser = auto_tool_parser(enable_auto_tool_choice, tool_call_parser)
    thinker = get_reasoning_parser(reasoning_parser)
    if enable_log_outputs and not enable_log_requests:
        raise ValueError("--enable-log-outputs needs --enable-log-requests (vLLM's rule)")
    log = RequestLogger(max_log_len, enable_log_outputs) if enable_log_requests else None
    store = ResponseStore(max_stored_responses)  # a bad size is refused before the engine runs
    template = load_chat_template(chat_template) if chat_template is not None else None
    loras = parse_lora_modules(lora_modules)  # a malformed entry is refused before any start
    runtime_loras = runtime_updating_allowed(allow_runtime_lora_updating)
    wrapped = isinstance(engine, RequestFrontend)  # an LLMEngine or a CoreProcessEngine
    owned = wrapped if owned is None else owned
    aengine = AsyncLLMEngine(engine, start=False) if wrapped else engine
    names = ([served_model_name] if isinstance(served_model_name, str)
             else list(served_model_name or ())) or [default_model_name(aengine.model_source)]
    # Before the engine loop starts, so that a refusal leaves nothing running: LoRA off, an
    # adapter that does not read, or one named as the served model is refused.
    for i, module in enumerate(loras):
        # Numbered by the engine (an adapter it knows keeps its id; others get new ones).
        module = loras[i] = dataclasses.replace(
            module, lora_int_id=aengine.lora_id_for(module.lora_name))
        if module.lora_name in names:
            raise ValueError(f"--lora-modules {module.lora_name}: the name is the served "
                             "model's (--served-model-name); give the adapter its own")
        try:
            aengine.check_lora(module)
        except (ValueError, FileNotFoundError) as e:
            raise ValueError(f"--lora-modules {module.lora_name}: {e}") from None
    aengine.start()
    name = names[0]
    serving = _Serving(aengine, names, parser, template, log, thinker)
    serving.store = store
    serving.lora_modules.update((m.lora_name, m) for m in loras)
    # vLLM's labels on every series: model_name, and engine (the one engine's "0"; a
    # data-parallel client's series carry each replica's own, which win).
    registry = with_labels(aengine.metrics_registry(), {"model_name": name, "engine": "0"})
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> Any:
        yield
        await serving.close_responses()
        if owned:
            aengine.shutdown()

    app = FastAPI(title="jpaged", summary="OpenAI-compatible server of the jpaged engine",
                  lifespan=lifespan)
    app.state.engine = aengine
    app.state.served_model_name = name
    # vLLM's server load: generation requests from arrival until their answer (a stream: its
    # last event, or the client's hang-up) is sent. Read and written on the event loop only.
    app.state.server_load_metrics = 0

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        msg, param = _validation_message(exc)  # 400, as vLLM answers a malformed body
        return JSONResponse(error_body(msg, param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), type_), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestFailedError)
    async def _failed(_: Request, exc: RequestFailedError) -> JSONResponse:
        # The engine (or a data-parallel replica) failed while running this request.
        return JSONResponse(error_body(str(exc), "server_error", code=500), status_code=500)

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return JSONResponse(error_body(str(exc), "server_error", code=503), status_code=503)

    if api_key is not None:
        app.add_middleware(_ApiKeyGate, api_key=api_key)
    # Added last, so outermost: preflights are answered before the key is asked for.
    app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins),
                       allow_credentials=allow_credentials, allow_methods=["*"],
                       allow_headers=["*"])
    v1 = APIRouter(prefix="/v1")

    def respond(result: dict[str, Any] | EventStream | None,
                on_end: Callable[[], None] | None = None) -> Response:
        if result is None:  # the client disconnected; its requests were aborted
            return Response(status_code=499)
        if isinstance(result, EventStream):
            return _EventStreamResponse(result, on_end)
        return JSONResponse(result)

    async def load_aware(work: Awaitable[dict[str, Any] | EventStream | None]) -> Response:
        """`respond` to a generation request, counted in the server load while tracked."""
        if not enable_server_load_tracking:
            return respond(await work)
        app.state.server_load_metrics += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                app.state.server_load_metrics -= 1
        try:
            result = await work
        except BaseException:
            release()
            raise
        if not isinstance(result, EventStream):
            release()
        return respond(result, release)

    # A pooling model (--runner pooling) embeds and does not generate: the generation
    # endpoints answer a 400 saying so (and /v1/embeddings and /score one on a generating
    # server).
    pooling = getattr(aengine, "pooler", None) is not None

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        """OpenAI completions: prompt(s) in, text out (stream=true: server-sent events)."""
        if pooling:
            raise pooling_only_error("/v1/completions")
        return await load_aware(serving.completion(body, request))

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """OpenAI chat completions over the model's chat template."""
        if pooling:
            raise pooling_only_error("/v1/chat/completions")
        return await load_aware(serving.chat(body, request))

    @v1.post("/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        """OpenAI's Responses API: a response, its event stream, or a background run."""
        if pooling:
            raise pooling_only_error("/v1/responses")
        return await load_aware(serving.responses(body, request))

    @v1.post("/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        """OpenAI embeddings (a pooling model, --runner pooling): a vector per input."""
        return await load_aware(serving.embeddings(body, request))

    async def score(body: ScoreRequest, request: Request) -> Response:
        """vLLM's score API (an embedding model): the cosine similarity of text pairs."""
        return await load_aware(serving.score(body, request))

    # vLLM serves it at both (/v1/score being its first, OpenAI-looking route).
    app.add_api_route("/score", score, methods=["POST"])
    v1.add_api_route("/score", score, methods=["POST"])

    async def rerank(body: RerankRequest, request: Request) -> Response:
        """vLLM's rerank API (Jina's and Cohere's shape): a query's documents, best first."""
        return await load_aware(serving.rerank(body, request))

    app.add_api_route("/rerank", rerank, methods=["POST"])
    v1.add_api_route("/rerank", rerank, methods=["POST"])
    app.add_api_route("/v2/rerank", rerank, methods=["POST"])

    @app.post("/pooling")
    async def pooling_api(body: EmbeddingRequest, request: Request) -> Response:
        """vLLM's pooling API: each input's pooled output as it is (an embedding model's
        vector, a classifier's probabilities), under `data`."""
        return await load_aware(serving.pooling(body, request))

    @app.post("/classify")
    async def classify(body: ClassificationRequest, request: Request) -> Response:
        """vLLM's classification API (a sequence classifier): class probabilities per input."""
        return await load_aware(serving.classify(body, request))

    # SageMaker's /invocations (vLLM's): one route to every API this model serves, chosen by
    # the body in vLLM's order (chat before completions; an embedding model's or a classifier's
    # own API, then rerank, then score). vLLM takes the first request type that validates;
    # here each type is known by the fields only it needs, so that a body meant for one API
    # gets that API's own 400 for a bad field instead of falling through to another.
    if not pooling:
        invocation_types: list[tuple[tuple[str, ...], type, Callable[..., Any]]] = [
            (("messages",), ChatCompletionRequest, chat_completions),
            (("prompt",), CompletionRequest, completions)]
    else:
        own = ((ClassificationRequest, classify) if aengine.labels
               else (EmbeddingRequest, embeddings))
        invocation_types = [(("input", "messages"), *own), (("query",), RerankRequest, rerank),
                            (SCORE_SIDES, ScoreRequest, score)]

    @app.post("/invocations")
    async def invocations(request: Request) -> Response:
        """SageMaker's inference route: the body answered by the API whose fields it gives."""
        try:
            body = await request.json()
        except ValueError as e:
            raise OpenAIError(400, f"the request body is not valid JSON ({e})") from None
        if not isinstance(body, dict):
            raise OpenAIError(400, "the request body must be a JSON object")
        for fields, request_type, endpoint in invocation_types:
            if any(f in body for f in fields):
                try:
                    parsed = request_type.model_validate(body)
                except ValidationError as e:
                    raise RequestValidationError(e.errors()) from None
                return await endpoint(parsed, request)
        expected = "; ".join(f"{t.__name__} ({' or '.join(f)})" for f, t, _ in invocation_types)
        raise OpenAIError(400, "no API of this model takes the request: give the fields of one "
                          f"of {expected}")

    @v1.get("/responses/{response_id}")
    async def retrieve_response(response_id: str, stream: bool = False,
                                starting_after: int | None = None) -> Response:
        """A stored response (a background one as it stands); stream=true: a background
        stream's events again, after `starting_after`."""
        if stream:
            return respond(serving.stream_again(response_id, starting_after))
        return JSONResponse(serving.retrieve_response(response_id))

    @v1.post("/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> dict[str, Any]:
        """Cancel a background response."""
        return await serving.cancel_response(response_id)

    @v1.delete("/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        """Forget a stored response."""
        return await serving.delete_response(response_id)

    @v1.get("/responses/{response_id}/input_items")
    async def response_input_items(response_id: str, order: str = "desc", limit: int = 20,
                                   after: str | None = None) -> dict[str, Any]:
        """A stored response's input items, OpenAI's list page."""
        return serving.input_items(response_id, order, limit, after)

    def card(model_id: str) -> dict[str, Any]:
        lora = serving.lora_modules.get(model_id) if model_id not in names else None
        if lora is not None:  # vLLM's adapter card: its directory, the base model as parent
            return {"id": model_id, "object": "model", "created": created,
                    "owned_by": "jpaged", "root": lora.lora_path,
                    "parent": (lora.base_model_name if lora.base_model_name in names
                               else name),
                    "max_model_len": aengine.max_model_len}
        return {"id": model_id, "object": "model", "created": created, "owned_by": "jpaged",
                "root": aengine.model_source, "parent": None,
                "max_model_len": aengine.max_model_len}

    @v1.get("/models")
    async def models() -> dict[str, Any]:
        """The served model, a card per name it is served under, then each LoRA adapter."""
        return {"object": "list", "data": [card(n) for n in [*names, *serving.lora_modules]]}

    @v1.get("/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        """The served model's or an adapter's card (404 for any other id), for
        `client.models.retrieve`."""
        if model_id not in names and model_id not in serving.lora_modules:
            raise OpenAIError(404, f"The model `{model_id}` does not exist.", param="model",
                              code="model_not_found")
        return card(model_id)

    config = getattr(getattr(aengine, "engine", None), "config", None)
    if config is not None and config.model.enable_sleep_mode:  # vLLM's sleep-mode routes
        async def done_or_400(work: Awaitable[Any], param: str) -> Response:
            try:
                await work
            except ValueError as e:
                raise OpenAIError(400, str(e), param=param) from None
            return Response(status_code=200)

        @app.post("/sleep")
        async def sleep(level: int = 1) -> Response:
            """Give the device memory back while no request runs (LLM.sleep)."""
            return await done_or_400(aengine.sleep(level), "level")

        @app.post("/wake_up")
        async def wake_up(tags: Annotated[list[str] | None, Query()] = None) -> Response:
            """Take it back: ?tags=weights, ?tags=kv_cache, or both (no tags)."""
            return await done_or_400(aengine.wake_up(tags), "tags")

        @app.get("/is_sleeping")
        async def is_sleeping() -> dict[str, bool]:
            """Whether the engine sleeps now."""
            return {"is_sleeping": aengine.is_sleeping()}

    if runtime_loras:
        load_lock = asyncio.Lock()

        @v1.post("/load_lora_adapter")
        async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
            """vLLM's runtime adapter loading: read and check it, then serve it by name."""
            name = body.lora_name
            if name in names or (name in serving.lora_modules and not body.load_inplace):
                raise OpenAIError(400, f"The lora adapter '{name}' has already been loaded.",
                                  param="lora_name")
            if body.load_inplace and name in serving.lora_modules:
                # vLLM's in-place reload: the directory is read anew (requests already queued
                # keep the weights they were queued with; later ones get these).
                await asyncio.get_running_loop().run_in_executor(None, aengine.drop_lora,
                                                                 name)
            try:
                async with load_lock:  # one at a time: each draws an id the others have not
                    module = LoRARequest(name, aengine.lora_id_for(name), body.lora_path)
                    await asyncio.get_running_loop().run_in_executor(None, aengine.check_lora,
                                                                     module)
            except FileNotFoundError as e:  # vLLM's answer to a path that is not there
                raise OpenAIError(404, str(e), param="lora_path",
                                  code="model_not_found") from None
            except ValueError as e:
                raise OpenAIError(400, str(e), param="lora_path") from None
            serving.lora_modules[name] = module
            logger.info("LoRA adapter %r loaded from %s", name, body.lora_path)
            return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

        @v1.post("/unload_lora_adapter")
        async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
            """vLLM's runtime adapter unloading: no new request may name it (running ones go
            on); its host copy is dropped."""
            name = body.lora_name
            if serving.lora_modules.pop(name, None) is None:
                raise OpenAIError(404, f"The lora adapter '{name}' cannot be found.",
                                  param="lora_name", code="model_not_found")
            await asyncio.get_running_loop().run_in_executor(None, aengine.drop_lora, name)
            logger.info("LoRA adapter %r unloaded", name)
            return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    app.include_router(v1)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        """vLLM's /tokenize: a prompt's (or chat messages') token ids, count, max_model_len."""
        return await serving.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        """vLLM's /detokenize: token ids back to text."""
        return await serving.detokenize(body)

    if enable_tokenizer_info_endpoint:
        @app.get("/tokenizer_info")
        async def tokenizer_info() -> dict[str, Any]:
            """vLLM's /tokenizer_info: special tokens, added tokens, chat template."""
            return serving.tokenizer_info()

    @app.get("/load")
    async def load() -> dict[str, int]:
        """vLLM's /load: generation requests in flight (0 unless load tracking is on)."""
        return {"server_load": app.state.server_load_metrics}

    @app.get("/version")
    async def version() -> dict[str, str]:
        """The jpaged version serving."""
        return {"version": __version__}

    @app.get("/health")
    async def health() -> Response:
        """200 while the engine loop runs (data parallel: any replica; JSON per replica)."""
        ok, details = aengine.health()
        if ok:
            return Response(status_code=200) if details is None else JSONResponse(details)
        body = error_body("the engine loop is not running", "server_error", code=503)
        if details is not None:
            body.update(details)
        return JSONResponse(body, status_code=503)

    app.add_api_route("/ping", health, methods=["GET", "POST"],
                      summary="vLLM's /ping (SageMaker's health check): /health's answer")

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus text exposition of the engine metrics (`jpaged:` names)."""
        body, content_type = render(registry)
        return Response(body, media_type=content_type)

    return app


def run_server(engine: LLMEngine | AsyncLLMEngine | DPEngineClient, host: str = DEFAULT_HOST,
               port: int = DEFAULT_PORT, log_level: str = "info", **app_options: Any) -> None:
    """Serve the OpenAI-compatible API with uvicorn until interrupted (blocking); the engine
    is shut down when the server stops. `app_options`: build_app's (api_key,
    served_model_name, the endpoint and logging options)."""
    app = build_app(engine, owned=True, **app_options)
    freeze_gc_heap()  # this process is the server's: start-up objects stay to the end
    logger.info("serving %s on http://%s:%d", app.state.served_model_name, host, port)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=5)
    uvicorn.Server(config).run()


class BackgroundServer:
    """A uvicorn server on a daemon thread (tests, notebooks); port 0 picks a free port."""

    def __init__(self, app: FastAPI, host: str = DEFAULT_HOST, port: int = 0,
                 log_level: str = "warning", start_timeout: float = 30.0) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = host, self._sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level,
                                                    timeout_graceful_shutdown=2))
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                        name="jpaged-uvicorn", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + start_timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not start on {host}:{self.port}")
            time.sleep(0.02)

    @property
    def url(self) -> str:
        """Base URL, e.g. http://127.0.0.1:41234."""
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 10.0) -> None:
        """Ask uvicorn to exit (running the app's shutdown) and wait for it."""
        self.server.should_exit = True
        self._thread.join(timeout)
        self._sock.close()

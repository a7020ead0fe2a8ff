"""``dsv4 serve``: an OpenAI-compatible HTTP server over the engine (docs/server.md).

`build_app` makes the FastAPI app: ``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``, ``/tokenize``, ``/detokenize``, ``/health`` and ``/metrics`` (Prometheus, vLLM's
names under ``dsv4:``). Every connection goes through one `EngineDriver`, whose thread owns the
engine; handlers turn bodies into `SamplingParams` and stream the outputs back (Server-Sent
Events). `ServerThread` runs it in a thread (tests, benchmarks); `run_server` is ``dsv4 serve``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from serving import openai_protocol as api
from serving.engine_driver import EngineDriver
from serving.llm import LLM
from serving.outputs import CompletionOutput, RequestOutput
from serving.sampling_params import SamplingParams
from serving.server_metrics import ServerMetrics

__all__ = ["ServerOptions", "ServerThread", "build_app", "run_server"]


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    """What the server adds to the engine (the ``dsv4 serve`` flags of the same names)."""

    served_model_name: str
    api_key: str | None = None  # None: no key asked
    max_waiting_requests: int | None = None  # sequences beyond max_num_seqs; None: no limit


class HTTPError(Exception):
    """A request the server refuses: its status, message, the field at fault, headers."""

    def __init__(self, status: int, message: str, param: str | None = None, headers=None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


_NO_TOKENIZER = "{what} needs a tokenizer and the server runs with --skip-tokenizer-init"


def _short(text: str, most: int = 40) -> str:
    return text if len(text) <= most else text[: most - 3] + "..."


def _param_of(message: str) -> str | None:
    """The field a ``name=value is not allowed`` message names (`SamplingParams`' errors)."""
    head = message.split("=", 1)[0]
    return head if "=" in message and head.isidentifier() else None


def _bad_request(exc: Exception) -> HTTPError:
    return HTTPError(400, str(exc), _param_of(str(exc)))


@dataclasses.dataclass
class _Submitted:
    """One HTTP request's engine requests (one per prompt) and the queue of their outputs."""

    ids: list[str]
    prompts: list[tuple[str | None, list[int]]]
    queue: asyncio.Queue
    num_sequences: int
    finished: set[str] = dataclasses.field(default_factory=set)


class _Serving:
    """The app's state: the model, the driver, the options and the admission count."""

    def __init__(self, llm: LLM, driver: EngineDriver, options: ServerOptions) -> None:
        self.llm, self.driver, self.options = llm, driver, options
        self.engine = driver.engine
        # None: the LLM was built with skip_tokenizer_init (token ids in, token ids out)
        self.tokenizer = llm.get_tokenizer()
        self.metrics = ServerMetrics(options.served_model_name)
        driver.observers.append(self.metrics.observe_step)
        sched = self.engine.config.scheduler_config
        self.capacity = sched.max_num_seqs * self.engine.data_parallel_size
        self.active = 0  # sequences admitted and not finished (the event loop's count)
        self.draining = False
        self.inbox: _Inbox | None = None  # the event loop's, made on the first request

    # ---------------------------------------------------------------- checks

    def check_model(self, model: str | None) -> None:
        name = self.options.served_model_name
        if model is not None and model != name:
            raise HTTPError(404, f"model {model!r} does not exist; this server serves {name!r}")

    def decode_one(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])

    def encode(self, prompt: Any) -> tuple[str | None, list[int]]:
        """A prompt (text or token ids) as (text, token ids); text gets BOS as in `LLM`."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise HTTPError(
                    400,
                    f"prompt={_short(prompt)!r}: a text prompt needs a tokenizer and the server "
                    "runs with --skip-tokenizer-init; give token ids",
                    "prompt",
                )
            if not prompt:
                raise HTTPError(400, "prompt='' is not allowed: a non-empty text", "prompt")
            tok = self.tokenizer
            return prompt, tok.encode(prompt, add_bos=tok.bos_id is not None)
        return None, list(prompt)

    def render_chat(self, messages, add_generation_prompt: bool) -> str:
        if self.tokenizer is None:
            raise HTTPError(400, _NO_TOKENIZER.format(what="chat"), "messages")
        if self.llm.chat_template is None:
            raise HTTPError(400, f"{self.options.served_model_name} has no chat template")
        try:
            return self.llm.render_chat(
                api.messages_as_dicts(messages), add_generation_prompt=add_generation_prompt
            )
        except Exception as exc:  # a template error is the request's messages
            raise HTTPError(400, f"the chat template failed on these messages: {exc}") from exc

    # ---------------------------------------------------------------- admission

    def submit(self, prompts: list[tuple[str | None, list[int]]], params, kind: str) -> _Submitted:
        """Check every prompt, then queue them all (nothing is queued when one is bad)."""
        if self.draining or not self.driver.alive:
            raise HTTPError(503, "the server is shutting down", headers={"Retry-After": "5"})
        ids = [f"{kind}-{uuid.uuid4().hex}-{i}" for i in range(len(prompts))]
        field = "messages" if kind == "chatcmpl" else "prompt"
        for i, (request_id, (_, token_ids)) in enumerate(zip(ids, prompts, strict=True)):
            where = field if len(prompts) == 1 else f"{field}[{i}]"  # as the client sent it
            try:
                self.engine.check_request(request_id, token_ids, params, where=where)
            except (ValueError, TypeError) as exc:
                raise _bad_request(exc) from None
        num = params.n * len(prompts)
        limit = self.options.max_waiting_requests
        if limit is not None and self.active + num - self.capacity > limit:
            waiting = max(0, self.active - self.capacity)
            raise HTTPError(
                503,
                f"the server is busy: {waiting} sequences wait beyond the {self.capacity} that "
                f"run (--max-waiting-requests {limit}); retry later",
                headers={"Retry-After": "1"},
            )
        loop = asyncio.get_running_loop()
        if self.inbox is None or self.inbox.loop is not loop:
            self.inbox = _Inbox(loop)
        queue: asyncio.Queue = asyncio.Queue()
        for index, request_id in enumerate(ids):
            text, token_ids = prompts[index]
            sink = self.inbox.sink(queue, index)
            self.driver.add(request_id, token_ids, params, sink, prompt=text)
        self.active += num
        return _Submitted(ids, prompts, queue, num)

    def release(self, sub: _Submitted) -> None:
        """Abort what is unfinished (a client gone, an error) and give back its admission."""
        for request_id in sub.ids:
            if request_id not in sub.finished:
                self.driver.abort(request_id)
        self.active -= sub.num_sequences
        sub.num_sequences = 0

    async def outputs(
        self, sub: _Submitted, request: Request
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) as the engine produces them, until every prompt's request
        finished; a client that disconnects is noticed within half a second. Outputs are
        cumulative: of those waiting at once, each request's last one is enough."""
        checked = time.monotonic()
        while len(sub.finished) < len(sub.ids):
            batch = _drain(sub.queue)
            if not batch:
                with contextlib.suppress(TimeoutError):
                    batch = [await asyncio.wait_for(sub.queue.get(), 0.5)]
                batch += _drain(sub.queue)
            if not batch or time.monotonic() - checked > 0.5:
                checked = time.monotonic()
                if await request.is_disconnected():
                    return
            for index, item in _latest(batch):
                if isinstance(item, (ValueError, TypeError)):
                    raise _bad_request(item)
                if isinstance(item, BaseException):
                    raise HTTPError(500, f"the engine failed: {item!r}")
                if item.finished:
                    sub.finished.add(item.request_id)
                yield index, item

    async def final_outputs(self, sub: _Submitted, request: Request) -> list[RequestOutput]:
        """Every prompt's finished output, in order (then the request is released)."""
        finals: dict[int, RequestOutput] = {}
        try:
            async for index, out in self.outputs(sub, request):
                if out.finished:
                    finals[index] = out
        finally:
            self.release(sub)
        if len(finals) < len(sub.ids):
            raise HTTPError(499, "the client disconnected")
        return [finals[i] for i in range(len(sub.ids))]


class _Inbox:
    """The driver thread's outputs for one event loop. The sinks append to one list and wake
    the loop once for all of a step's outputs, not once per request and token."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._items: list[tuple[asyncio.Queue, int, Any]] = []
        self._lock = threading.Lock()

    def sink(self, queue: asyncio.Queue, index: int):
        """A request's sink (`EngineDriver.add`): its items go to ``queue`` as (index, item)."""

        def put(item) -> None:
            with self._lock:
                self._items.append((queue, index, item))
                first = len(self._items) == 1
            if first:
                with contextlib.suppress(RuntimeError):  # the loop closed: nobody listens
                    self.loop.call_soon_threadsafe(self._hand_out)

        return put

    def _hand_out(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for queue, index, item in items:
            queue.put_nowait((index, item))


def _drain(queue: asyncio.Queue) -> list:
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


def _latest(batch: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
    """``batch`` without the outputs a later output of the same request supersedes (outputs
    are cumulative); errors stay where they are."""
    last = {id_: pos for pos, (_, item) in enumerate(batch) if (id_ := _output_id(item))}
    return [x for pos, x in enumerate(batch) if last.get(_output_id(x[1]), pos) == pos]


def _output_id(item: Any) -> str | None:
    return item.request_id if isinstance(item, RequestOutput) else None


# -- sampling parameters -----------------------------------------------------------------------


def _sampling_params(
    body, *, max_tokens, logprobs, prompt_logprobs=None, detokenize=True
) -> SamplingParams:
    """The body's `SamplingParams` (OpenAI's and vLLM's fields; unset ones keep their
    defaults); its ValueError or TypeError becomes a 400 naming the field."""
    # the body's fields of the same name, those left unset (None) at SamplingParams' defaults
    same = ("n", "presence_penalty", "frequency_penalty", "stop", "seed", "min_tokens",
            "ignore_eos", "stop_token_ids", "skip_special_tokens", "include_stop_str_in_output",
            "best_of")  # fmt: skip
    optional = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
    refused = api.unsupported(body)
    if refused is not None:
        name, value = refused
        message = f"{name}={_short(repr(value))} is not supported: {api.UNSUPPORTED[name]}"
        raise HTTPError(400, message, name)
    kw: dict[str, Any] = {name: getattr(body, name) for name in same}
    kw.update({n: getattr(body, n) for n in optional if getattr(body, n) is not None})
    kw.update(max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
    kw["detokenize"] = detokenize
    try:
        return SamplingParams(**kw)
    except (ValueError, TypeError) as exc:
        raise _bad_request(exc) from None


# -- text deltas -------------------------------------------------------------------------------


class _Delta:
    """What of a choice's cumulative output is new (text, tokens, logprobs), holding back text
    that may still change: a partial UTF-8 character at the end, and as many characters as the
    longest stop string less one (the engine cuts the text before a stop string). The pieces
    concatenate to the final text."""

    def __init__(self, stops: list[str]) -> None:
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.num_chars = 0
        self.num_tokens = 0

    def step(self, c: CompletionOutput) -> tuple[str, list[int], list | None]:
        text = c.text
        end = len(text)
        if c.finish_reason is None:
            end -= self.hold
            while end > self.num_chars and text[end - 1] == "\ufffd":
                end -= 1
        piece = text[self.num_chars : end] if end > self.num_chars else ""
        self.num_chars += len(piece)
        tokens = c.token_ids[self.num_tokens :]
        logprobs = None if c.logprobs is None else c.logprobs[self.num_tokens :]
        self.num_tokens = len(c.token_ids)
        return piece, tokens, logprobs


# -- the app -----------------------------------------------------------------------------------


def build_app(llm: LLM, driver: EngineDriver, options: ServerOptions) -> FastAPI:
    """The server's FastAPI app over ``driver`` (started by the caller; several apps may share
    one driver). Its state is ``app.state.serving``."""
    app = FastAPI(title="dsv4 serve")
    state = _Serving(llm, driver, options)
    app.state.serving = state
    _add_errors(app)
    _add_info_routes(app, state)
    _add_completion_route(app, state)
    _add_chat_route(app, state)
    return app


def _error(status: int, message: str, param: str | None = None, headers=None) -> JSONResponse:
    return JSONResponse(api.error_body(status, message, param), status, headers=headers)


def _key_check(state: _Serving):
    """The dependency of every route but /health and /metrics: the API key, when one is set."""

    async def check_key(request: Request) -> None:
        key = state.options.api_key
        if key is not None and request.headers.get("authorization") != f"Bearer {key}":
            raise HTTPError(401, "missing or wrong API key (Authorization: Bearer KEY)")

    return [Depends(check_key)]


def _add_errors(app: FastAPI) -> None:
    @app.exception_handler(HTTPError)
    async def http_error(request: Request, exc: HTTPError):
        return _error(exc.status, exc.message, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, exc: RequestValidationError):
        # malformed JSON or a field of the wrong type: 400 as OpenAI answers, not FastAPI's 422
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            where, why = first.get("loc", ("body", "?"))[-1], first.get("ctx", {}).get("error")
            return _error(400, f"malformed JSON in the request body at character {where}: {why}")
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        where = ".".join(loc)
        message = f"{where}: {first.get('msg', 'invalid')}" if where else first.get("msg", "")
        if where and "input" in first:
            message += f" (got {_short(repr(first['input']), 60)})"
        return _error(400, message or "malformed request body", loc[-1] if loc else None)


def _add_info_routes(app: FastAPI, state: _Serving) -> None:
    @app.get("/health")
    async def health():
        if state.draining or not state.driver.alive:
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=_key_check(state))
    async def models():
        card = {
            "id": state.options.served_model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "dsv4",
            "root": state.llm.config.model_config.model,
            "max_model_len": state.engine.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/tokenize", dependencies=_key_check(state))
    async def tokenize(body: api.TokenizeRequest, request: Request):
        state.check_model(body.model)
        if state.tokenizer is None:
            raise HTTPError(400, _NO_TOKENIZER.format(what=request.url.path))
        if (body.prompt is None) == (body.messages is None):
            raise HTTPError(400, "give one of prompt or messages", "prompt")
        text = body.prompt
        if body.messages is not None:
            text = state.render_chat(body.messages, body.add_generation_prompt)
        tok = state.tokenizer
        tokens = tok.encode(text, add_bos=body.add_special_tokens and tok.bos_id is not None)
        return {"count": len(tokens), "max_model_len": state.engine.max_model_len, "tokens": tokens}

    @app.post("/detokenize", dependencies=_key_check(state))
    async def detokenize(body: api.DetokenizeRequest, request: Request):
        state.check_model(body.model)
        if state.tokenizer is None:
            raise HTTPError(400, _NO_TOKENIZER.format(what=request.url.path))
        vocab = state.engine.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise HTTPError(
                400, f"tokens {bad[:8]} are outside the vocabulary [0, {vocab})", "tokens"
            )
        return {"prompt": state.tokenizer.decode(body.tokens)}


def _meta(state: _Serving, sub: _Submitted) -> dict[str, Any]:
    """The id, creation time and model every response and chunk carries."""
    request_id = sub.ids[0].rsplit("-", 1)[0]  # the engine ids add "-{prompt index}"
    name = state.options.served_model_name
    return {"id": request_id, "created": int(time.time()), "model": name}


def _streamed(state, body, sub, request, obj: str, chunks) -> StreamingResponse:
    usage = body.stream_options is not None and body.stream_options.include_usage
    events = _sse_events(state, sub, request, {**_meta(state, sub), "object": obj}, chunks, usage)
    return StreamingResponse(events, media_type="text/event-stream")


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


# -- /v1/completions ---------------------------------------------------------------------------


def _completion_prompts(state: _Serving, prompt) -> list[tuple[str | None, list[int]]]:
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise HTTPError(400, "prompt=[] is not allowed: at least one prompt", "prompt")
    return [state.encode(p) for p in prompt]


def _add_completion_route(app: FastAPI, state: _Serving) -> None:
    @app.post("/v1/completions", dependencies=_key_check(state))
    async def completions(body: api.CompletionRequest, request: Request):
        state.check_model(body.model)
        prompts = _completion_prompts(state, body.prompt)
        echo_logprobs = body.logprobs if body.echo else None
        params = _sampling_params(
            body,
            max_tokens=body.max_tokens,
            logprobs=body.logprobs,
            prompt_logprobs=echo_logprobs,
            detokenize=state.tokenizer is not None,
        )
        sub = state.submit(prompts, params, "cmpl")
        if body.stream:
            chunks = _completion_chunks(state, body, params)
            return _streamed(state, body, sub, request, "text_completion", chunks)
        finals = await state.final_outputs(sub, request)
        choices = [
            _completion_choice(state, body, out, c, p * params.n + c.index)
            for p, out in enumerate(finals)
            for c in out.outputs
        ]
        n_prompt = sum(len(o.prompt_token_ids) for o in finals)
        n_out = sum(len(c.token_ids) for o in finals for c in o.outputs)
        return {
            **_meta(state, sub),
            "object": "text_completion",
            "choices": choices,
            "usage": api.usage(n_prompt, n_out),
        }


def _echo_part(state: _Serving, body, out: RequestOutput) -> tuple[str, dict | None]:
    """The prompt's text and, with logprobs, its logprobs object (the first one None)."""
    text = out.prompt
    if text is None:
        text = "" if state.tokenizer is None else state.tokenizer.decode(out.prompt_token_ids)
    if body.logprobs is None:
        return text, None
    entries = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
    return text, api.completion_logprobs(out.prompt_token_ids, entries, state.decode_one)


def _completion_choice(state: _Serving, body, out: RequestOutput, c, index: int) -> dict:
    text, logprobs = c.text, None
    if body.logprobs is not None:
        prefix = ""
        if body.echo:
            prefix, echo_lp = _echo_part(state, body, out)
        logprobs = api.completion_logprobs(c.token_ids, c.logprobs, state.decode_one, len(prefix))
        if body.echo:
            logprobs = {k: echo_lp[k] + logprobs[k] for k in logprobs}
    if body.echo:
        text = _echo_part(state, body, out)[0] + text
    choice = {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": c.finish_reason,
        "stop_reason": c.stop_reason,
    }
    if body.return_token_ids or state.tokenizer is None:
        choice["token_ids"] = list(c.token_ids)
        choice["prompt_token_ids"] = list(out.prompt_token_ids)
    return choice


def _completion_chunks(state: _Serving, body, params):
    """The streamed choices of a completion: ``chunks(p, out)`` lists (choice, new tokens) for
    each of prompt p's choices with something new (echo and logprobs included)."""
    deltas: dict[tuple[int, int], _Delta] = {}

    def chunks(p: int, out: RequestOutput) -> list[tuple[dict, int]]:
        found = []
        for c in out.outputs:
            first = (p, c.index) not in deltas
            delta = deltas.setdefault((p, c.index), _Delta(params.stop))
            text, tokens, entries = delta.step(c)
            logprobs = None
            if body.logprobs is not None:
                offset = delta.num_chars - len(text)
                logprobs = api.completion_logprobs(tokens, entries, state.decode_one, offset)
            if first and body.echo:
                echo, echo_lp = _echo_part(state, body, out)
                text = echo + text
                if logprobs is not None:
                    logprobs = {k: echo_lp[k] + logprobs[k] for k in logprobs}
            if not text and not tokens and c.finish_reason is None:
                continue
            choice = {"index": p * params.n + c.index, "text": text, "logprobs": logprobs}
            choice.update(finish_reason=c.finish_reason, stop_reason=c.stop_reason)
            if body.return_token_ids or state.tokenizer is None:
                choice["token_ids"] = tokens
                if first:
                    choice["prompt_token_ids"] = list(out.prompt_token_ids)
            found.append((choice, len(tokens)))
        return found

    return chunks


async def _sse_events(state, sub, request, meta, chunks, include_usage) -> AsyncIterator[str]:
    """Server-Sent Events of one request: a chunk per new choice piece (`chunks`), the usage
    last when asked, then ``[DONE]``. An error once the stream has begun ends it as vLLM's do:
    an error chunk in OpenAI's shape, then ``[DONE]``. Whatever ends it releases the request."""
    n_prompt = n_out = 0
    try:
        async for p, out in state.outputs(sub, request):
            pieces = []  # one write for all of an output's chunks (its n choices)
            for choice, num_tokens in chunks(p, out):
                chunk = {**meta, "choices": [choice]}
                pieces.append(_sse({**chunk, "usage": None} if include_usage else chunk))
                n_out += num_tokens
            if pieces:
                yield "".join(pieces)
            if out.finished:
                n_prompt += len(out.prompt_token_ids)
        if len(sub.finished) < len(sub.ids):
            return  # the client left
        if include_usage:
            yield _sse({**meta, "choices": [], "usage": api.usage(n_prompt, n_out)})
    except HTTPError as exc:
        yield _sse(api.error_body(exc.status, exc.message, exc.param))
    except Exception as exc:  # a fault of the server's own: the client still hears of it
        yield _sse(api.error_body(500, f"the server failed: {exc!r}"))
    finally:
        state.release(sub)
    yield "data: [DONE]\n\n"


# -- /v1/chat/completions ----------------------------------------------------------------------


def _add_chat_route(app: FastAPI, state: _Serving) -> None:
    @app.post("/v1/chat/completions", dependencies=_key_check(state))
    async def chat(body: api.ChatCompletionRequest, request: Request):
        state.check_model(body.model)
        text = state.render_chat(body.messages, body.add_generation_prompt)
        prompts = [state.encode(text)]
        top = body.top_logprobs
        if top is not None and not body.logprobs:
            raise HTTPError(400, f"top_logprobs={top} needs logprobs=true", "top_logprobs")
        max_tokens = body.max_completion_tokens or body.max_tokens
        logprobs = (top or 0) if body.logprobs else None
        params = _sampling_params(body, max_tokens=max_tokens, logprobs=logprobs)
        sub = state.submit(prompts, params, "chatcmpl")
        if body.stream:
            chunks = _chat_chunks(state, body, params)
            return _streamed(state, body, sub, request, "chat.completion.chunk", chunks)
        (out,) = await state.final_outputs(sub, request)
        choices = []
        for c in out.outputs:
            lp = None
            if body.logprobs:
                lp = api.chat_logprobs(c.token_ids, c.logprobs, top or 0, state.decode_one)
            choice = {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": lp,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            if body.return_token_ids:
                choice["token_ids"] = list(c.token_ids)
                choice["prompt_token_ids"] = list(out.prompt_token_ids)
            choices.append(choice)
        n_out = sum(len(c.token_ids) for c in out.outputs)
        return {
            **_meta(state, sub),
            "object": "chat.completion",
            "choices": choices,
            "usage": api.usage(len(out.prompt_token_ids), n_out),
        }


def _chat_chunks(state: _Serving, body, params):
    """The streamed choices of a chat completion (`_completion_chunks`' counterpart): the
    first delta of a choice carries the role."""
    deltas: dict[int, _Delta] = {}
    top = body.top_logprobs or 0

    def chunks(_: int, out: RequestOutput) -> list[tuple[dict, int]]:
        found = []
        for c in out.outputs:
            first = c.index not in deltas
            delta = deltas.setdefault(c.index, _Delta(params.stop))
            text, tokens, entries = delta.step(c)
            if not first and not text and not tokens and c.finish_reason is None:
                continue
            message = {"role": "assistant", "content": text} if first else {"content": text}
            logprobs = None
            if body.logprobs:
                logprobs = api.chat_logprobs(tokens, entries, top, state.decode_one)
            choice = {"index": c.index, "delta": message, "logprobs": logprobs}
            choice["finish_reason"] = c.finish_reason
            if body.return_token_ids:
                choice["token_ids"] = tokens
            found.append((choice, len(tokens)))
        return found

    return chunks


# -- running it --------------------------------------------------------------------------------


class _Server(uvicorn.Server):
    """uvicorn's server that says where it listens once it does, refuses new requests while it
    drains (``/health`` 503), and on SIGTERM / SIGINT drains and returns (exit status 0) instead
    of re-raising the signal."""

    def __init__(self, config: uvicorn.Config, state: _Serving, announce: bool) -> None:
        super().__init__(config)
        self.serving, self.announce = state, announce

    @property
    def url(self) -> str:
        host, port = self.servers[0].sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self.announce:
            print(f"dsv4 serve: ready, listening on {self.url}", flush=True)

    async def shutdown(self, sockets=None) -> None:
        self.serving.draining = True
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        signals = (signal.SIGINT, signal.SIGTERM)
        previous = {s: signal.signal(s, self.handle_exit) for s in signals}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


def _uvicorn_config(app, host: str, port: int, shutdown_timeout, log_level: str):
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        lifespan="off",
        timeout_graceful_shutdown=shutdown_timeout,
    )


class ServerThread:
    """The app served on ``host:port`` (0: a free port) from a thread: `start` returns once
    it listens (``url``); `stop` drains as SIGTERM does (``shutdown_timeout``) and joins."""

    def __init__(self, app: FastAPI, host="127.0.0.1", port=0, shutdown_timeout=None) -> None:
        config = _uvicorn_config(app, host, port, shutdown_timeout, "warning")
        self.server = _Server(config, app.state.serving, announce=False)
        self.thread = threading.Thread(target=self.server.run, name="dsv4-serve", daemon=True)

    def start(self, timeout: float = 60.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    @property
    def url(self) -> str:
        return self.server.url

    def stop(self, timeout: float | None = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)


def run_server(
    llm: LLM, options: ServerOptions, *, host: str, port: int, shutdown_timeout: float | None
) -> int:
    """``dsv4 serve``: serve ``llm`` (built and warmed up) until SIGTERM or SIGINT, then drain
    the running requests (up to ``shutdown_timeout`` seconds) and return 0."""
    driver = EngineDriver(llm.llm_engine).start()
    app = build_app(llm, driver, options)
    server = _Server(
        _uvicorn_config(app, host, port, shutdown_timeout, "info"), app.state.serving, True
    )
    server.run()
    driver.stop(timeout=30.0)
    return 0

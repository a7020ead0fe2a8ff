"""`dsv4 serve`'s app (`serving.server`) through the real `openai` client over HTTP on
127.0.0.1: one server over the session's `LLM("tiny_v41_trained")` (tests/conftest.py). Every
answer is checked against `LLM.generate` / `LLM.chat` on the same engine (run on the driver
thread while no HTTP request runs): text and token prompts, streamed and not, chat, n > 1, stop
strings, echo with prompt logprobs, 32 concurrent streams, disconnects, errors in OpenAI's shape
(mid-stream too), the API key, the waiting-queue limit, /metrics, a drain, and a second server
over an LLM without a tokenizer and with n-gram drafts (skip_tokenizer_init, spec counters).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import http.client
import json
import os
import re
import threading
import time
import urllib.error
import urllib.request

import jax
import openai
import pytest

from dsv4.checkpoint import shipped_checkpoint
from serving import LLM, SamplingParams
from serving.engine_driver import EngineDriver
from serving.metrics import compilation_count
from serving.server import ServerOptions, ServerThread, build_app

KEY = "test-key"
NAME = "tiny"
PROMPTS = [
    'def read_lines(path):\n    """Return the lines of the file at *path*',
    "class ConfigError(Exception):\n    ",
    "import os\nimport sys\n\n\ndef main(argv=None):\n    parser = argparse.",
]


class HighestDriver(EngineDriver):
    """The engine's thread with full-precision matmuls, those the session LLM was compiled
    with (tests/conftest.py; a thread starts with JAX's defaults)."""

    def _run(self) -> None:
        with jax.default_matmul_precision("highest"):
            super()._run()


class Served:
    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        # warmed up again (padding only, nothing read or written): after an earlier module
        # tests/conftest.py may have dropped JAX's executables, the session LLM's among them
        with jax.default_matmul_precision("highest"):
            llm.llm_engine.warm_up(progress=False)
        self.driver = HighestDriver(self.llm.llm_engine).start()
        self.app = build_app(self.llm, self.driver, ServerOptions(NAME, api_key=KEY))
        self.server = ServerThread(self.app).start()
        self.url = self.server.url
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0)
        self.compilations = compilation_count()  # nothing serving asks for compiles after this

    def offline(self, prompts, **params):
        """`LLM.generate` on the served engine, on the driver thread once it is idle."""
        sp = SamplingParams(**params)
        run = lambda: self.llm.generate(prompts, sp, use_tqdm=False)  # noqa: E731
        return self.driver.call_when_idle(run).result(timeout=300)

    def offline_chat(self, messages, **params):
        sp = SamplingParams(**params)
        run = lambda: self.llm.chat(messages, sp, use_tqdm=False)  # noqa: E731
        return self.driver.call_when_idle(run).result(timeout=300)


@pytest.fixture(scope="module")
def served(shipped_llm):
    s = Served(shipped_llm)
    yield s
    s.server.stop()
    s.driver.stop(timeout=30)


def request(url, path, body=None, *, key=KEY, raw: bytes | None = None):
    """(status, headers, parsed JSON or text) of a GET (no body) or POST."""
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            status, hdrs, text = resp.status, resp.headers, resp.read().decode()
    except urllib.error.HTTPError as exc:
        status, hdrs, text = exc.code, exc.headers, exc.read().decode()
    try:
        return status, hdrs, json.loads(text)
    except json.JSONDecodeError:
        return status, hdrs, text


def metric(url: str, name: str) -> float:
    _, _, text = request(url, "/metrics", key=None)
    values = re.findall(rf"^dsv4:{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert values, f"dsv4:{name} missing"
    return sum(float(v) for v in values)


def wait_idle(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while metric(url, "num_requests_running") or metric(url, "kv_cache_usage_perc"):
        assert time.monotonic() < deadline, "requests still running"
        time.sleep(0.05)


def extra(obj, name):
    return (obj.model_extra or {}).get(name)


# -- completions -------------------------------------------------------------------------------


def test_completions_text_and_token_prompts_equal_llm_generate(served):
    """Greedy: each prompt (text, then its token ids) answered as `LLM.generate` answers it,
    token for token; the stream's pieces concatenate to the same text and tokens."""
    want = served.offline(PROMPTS, temperature=0, max_tokens=12)
    token_prompts = [o.prompt_token_ids for o in want]
    for prompt, ref in zip(PROMPTS + token_prompts, want + want):
        kw = dict(model=NAME, prompt=prompt, max_tokens=12, temperature=0)
        kw["extra_body"] = {"return_token_ids": True}
        got = served.client.completions.create(**kw)
        choice = got.choices[0]
        assert extra(choice, "token_ids") == ref.outputs[0].token_ids
        assert extra(choice, "prompt_token_ids") == ref.prompt_token_ids
        assert choice.text == ref.outputs[0].text and choice.finish_reason == "length"
        assert got.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert got.usage.completion_tokens == 12
        text, tokens, reasons = "", [], []
        for chunk in served.client.completions.create(**kw, stream=True):
            text += chunk.choices[0].text
            tokens += extra(chunk.choices[0], "token_ids")
            reasons.append(chunk.choices[0].finish_reason)
        assert (text, tokens) == (ref.outputs[0].text, ref.outputs[0].token_ids)
        assert reasons[-1] == "length" and set(reasons[:-1]) <= {None}
    # a list of prompts: one choice per prompt, in order
    got = served.client.completions.create(model=NAME, prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.text for c in got.choices] == [o.outputs[0].text for o in want]
    assert [c.index for c in got.choices] == [0, 1, 2]


def test_sampled_n_stop_strings_and_usage_equal_llm_generate(served):
    """n = 3 seeded samples with penalties and vLLM's extra fields, streamed with each choice's
    index (and usage last) and not; a stop string cuts the text as `LLM.generate` cuts it."""
    params = dict(n=3, temperature=0.9, top_p=0.95, seed=7, max_tokens=10, presence_penalty=0.5)
    params.update(top_k=50, min_tokens=2, repetition_penalty=1.1)
    (ref,) = served.offline(PROMPTS[0], **params)
    body = {k: params[k] for k in ("top_k", "min_tokens", "repetition_penalty")}
    kw = dict(model=NAME, prompt=PROMPTS[0], n=3, temperature=0.9, top_p=0.95, seed=7)
    kw.update(max_tokens=10, presence_penalty=0.5, extra_body=body)
    got = served.client.completions.create(**kw)
    assert [c.text for c in got.choices] == [c.text for c in ref.outputs]
    assert len({c.text for c in got.choices}) > 1  # sampled: the choices differ
    texts = ["", "", ""]
    chunks = list(
        served.client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    for chunk in chunks[:-1]:
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == [c.text for c in ref.outputs]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 30
    # stop strings: greedy, cut before the first stop string found
    (plain,) = served.offline(PROMPTS[2], temperature=0, max_tokens=24)
    stop = plain.outputs[0].text[5:7]
    (ref,) = served.offline(PROMPTS[2], temperature=0, max_tokens=24, stop=[stop])
    assert ref.outputs[0].finish_reason == "stop"
    kw = dict(model=NAME, prompt=PROMPTS[2], temperature=0, max_tokens=24, stop=[stop])
    got = served.client.completions.create(**kw)
    assert got.choices[0].text == ref.outputs[0].text and got.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].text for c in served.client.completions.create(**kw, stream=True)
    )
    assert streamed == ref.outputs[0].text


def test_echo_with_logprobs_gives_the_prompt_logprobs_of_llm_generate(served):
    """echo + logprobs: the prompt's tokens with `LLM.generate`'s prompt logprobs (the first
    None), then the output's, as log-likelihood evaluation reads them over HTTP."""
    (ref,) = served.offline(PROMPTS[1], temperature=0, max_tokens=3, logprobs=2, prompt_logprobs=2)
    kw = dict(model=NAME, prompt=PROMPTS[1], max_tokens=3, temperature=0, echo=True, logprobs=2)
    got = served.client.completions.create(**kw).choices[0]
    assert got.text == PROMPTS[1] + ref.outputs[0].text
    ids = ref.prompt_token_ids + ref.outputs[0].token_ids
    entries = ref.prompt_logprobs + ref.outputs[0].logprobs
    want = [None] + [e[t].logprob for t, e in zip(ids[1:], entries[1:])]
    lp = got.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(want[1:], abs=1e-5)
    assert len(lp.tokens) == len(ids) and "".join(lp.tokens[1:]) == got.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    for top, e in zip(lp.top_logprobs[1:], entries[1:]):
        assert sorted(top.values()) == pytest.approx(sorted(x.logprob for x in e.values()))


# -- chat --------------------------------------------------------------------------------------


def test_chat_equals_llm_chat_streamed_and_not(served):
    """The shipped chat template renders the messages as `LLM.chat` does; greedy replies,
    their logprobs and the stream's deltas equal its output."""
    messages = [
        {"role": "system", "content": "Helpers for reading configuration files."},
        {"role": "user", "content": "def read_config(path):"},
    ]
    (ref,) = served.offline_chat(messages, temperature=0, max_tokens=10, logprobs=2)
    kw = dict(model=NAME, messages=messages, temperature=0, max_completion_tokens=10)
    got = served.client.chat.completions.create(**kw, logprobs=True, top_logprobs=2)
    c = got.choices[0]
    assert c.message.role == "assistant" and c.message.content == ref.outputs[0].text
    assert got.usage.prompt_tokens == len(ref.prompt_token_ids)
    want = [e[t].logprob for t, e in zip(ref.outputs[0].token_ids, ref.outputs[0].logprobs)]
    assert [x.logprob for x in c.logprobs.content] == pytest.approx(want, abs=1e-5)
    assert all(len(x.top_logprobs) == 2 for x in c.logprobs.content)
    deltas = list(served.client.chat.completions.create(**kw, stream=True))
    assert deltas[0].choices[0].delta.role == "assistant"
    assert "".join(d.choices[0].delta.content or "" for d in deltas) == ref.outputs[0].text
    assert deltas[-1].choices[0].finish_reason == ref.outputs[0].finish_reason


# -- concurrency and disconnects ---------------------------------------------------------------


def test_32_concurrent_streaming_clients_each_equal_their_offline_result(served):
    """32 async clients at once (8 run, the rest wait): each stream equals `LLM.generate` of
    its prompt; afterwards nothing runs and the pool is empty."""
    prompts = [f"{PROMPTS[i % 3]}{' ' * (i // 3)}" for i in range(32)]
    want = served.offline(prompts, temperature=0, max_tokens=8)

    async def one(client, prompt):
        kw = dict(model=NAME, prompt=prompt, max_tokens=8, temperature=0, stream=True)
        stream = await client.completions.create(**kw, extra_body={"return_token_ids": True})
        tokens = []
        async for chunk in stream:
            tokens += extra(chunk.choices[0], "token_ids")
        return tokens

    async def main():
        client = openai.AsyncOpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0)
        async with client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    got = asyncio.run(main())
    assert got == [o.outputs[0].token_ids for o in want]
    wait_idle(served.url)


def test_a_client_that_disconnects_has_its_request_aborted(served):
    """Close the connection mid-stream (and a non-streamed request while it runs): both
    requests are aborted, the request beside them finishes as `LLM.generate` says, and then
    /metrics shows nothing running and KV usage 0."""
    host, port = served.url.removeprefix("http://").split(":")
    body = dict(model=NAME, prompt=PROMPTS[0], max_tokens=100, temperature=0, ignore_eos=True)
    aborted = metric(served.url, "request_success_total")
    (ref,) = served.offline(PROMPTS[1], temperature=0, max_tokens=40)
    beside = threading.Thread(target=lambda: out.append(served.client.completions.create(
        model=NAME, prompt=PROMPTS[1], max_tokens=40, temperature=0)))  # fmt: skip
    out: list = []
    beside.start()
    for stream in (True, False):
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
        conn.request("POST", "/v1/completions", json.dumps({**body, "stream": stream}), headers)
        if stream:
            resp = conn.getresponse()
            assert resp.readline().startswith(b"data: ")
        else:
            time.sleep(1.0)
        conn.close()
    beside.join(60)
    assert out[0].choices[0].text == ref.outputs[0].text
    wait_idle(served.url)
    assert metric(served.url, "generation_tokens_total") > 0
    reasons = request(served.url, "/metrics", key=None)[2]
    assert 'finished_reason="abort"' in reasons
    assert metric(served.url, "request_success_total") >= aborted + 3


# -- errors ------------------------------------------------------------------------------------


def test_bad_requests_get_400_in_openai_shape_naming_the_value(served):
    """Each bad value is a 400 whose message names it (malformed JSON too, not 422); a wrong
    model is 404; the key is checked except on /health and /metrics; unknown fields are
    ignored; a stream beside the bad requests is undisturbed."""
    url = served.url
    (ref,) = served.offline(PROMPTS[0], temperature=0, max_tokens=30)
    out: list = []
    beside = threading.Thread(target=lambda: out.append("".join(
        c.choices[0].text for c in served.client.completions.create(
            model=NAME, prompt=PROMPTS[0], max_tokens=30, temperature=0, stream=True))))  # fmt: skip
    beside.start()
    vocab = served.llm.cfg.vocab_size
    cases = [
        ({"prompt": "x", "max_tokens": -1}, "max_tokens=-1"),
        ({"prompt": [5, vocab + 3]}, f"prompt: prompt token 1 is {vocab + 3}, outside"),
        ({"prompt": [[5], [5, vocab + 3]]}, f"prompt[1]: prompt token 1 is {vocab + 3}"),
        ({"prompt": [5] * 200}, "200 tokens"),
        ({"prompt": "x", "logprobs": 9}, "logprobs=9"),
        ({"prompt": "x", "temperature": -1}, "temperature=-1"),
        ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
        ({"prompt": "x", "stop_token_ids": [vocab]}, "stop_token_ids"),
        ({"prompt": ""}, "prompt=''"),
        ({}, "prompt"),
    ]
    for body, named in cases:
        status, _, got = request(url, "/v1/completions", {"model": NAME, **body})
        assert status == 400, (body, got)
        assert set(got["error"]) == {"message", "type", "param", "code"}
        assert named in got["error"]["message"] and got["error"]["code"] == 400, got
    status, _, got = request(url, "/v1/completions", raw=b'{"prompt": "x", ')
    assert status == 400 and got["error"]["type"] == "invalid_request_error"
    status, _, got = request(url, "/v1/chat/completions", {"messages": "hi"})
    assert status == 400 and "messages" in got["error"]["message"]
    status, _, got = request(url, "/v1/completions", {"model": "gpt-4", "prompt": "x"})
    assert status == 404 and "gpt-4" in got["error"]["message"]
    for key in (None, "wrong"):
        status, _, got = request(url, "/v1/models", key=key)
        assert status == 401 and got["error"]["code"] == 401
        assert request(url, "/health", key=key)[0] == 200
        assert request(url, "/metrics", key=key)[0] == 200
    body = {"model": NAME, "prompt": "x", "max_tokens": 2, "logit_bias": {}, "whatever": 1}
    assert request(url, "/v1/completions", body)[0] == 200
    # OpenAI's fields the server cannot honour are refused, never silently ignored
    chat = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for path, field, value in [
        ("/v1/completions", "logit_bias", {"17": 100}),
        ("/v1/completions", "suffix", "tail"),
        ("/v1/chat/completions", "response_format", {"type": "json_object"}),
        ("/v1/chat/completions", "tools", [{"type": "function", "function": {"name": "f"}}]),
    ]:
        base = body if path == "/v1/completions" else chat
        status, _, got = request(url, path, {**base, field: value})
        assert status == 400 and got["error"]["param"] == field, got
        assert f"{field}=" in got["error"]["message"]
    assert (
        request(url, "/v1/chat/completions", {**chat, "response_format": {"type": "text"}})[0]
        == 200
    )
    beside.join(60)
    assert out == [ref.outputs[0].text]
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        served.client.completions.create(model=NAME, prompt="x", max_tokens=0)


def test_over_max_waiting_requests_is_503_with_retry_after(served):
    """A second app on the same driver with --max-waiting-requests 0: with max_num_seqs (8)
    sequences running, the next request gets 503 and Retry-After; then it is served again."""
    app = build_app(served.llm, served.driver, ServerOptions(NAME, max_waiting_requests=0))
    server = ServerThread(app).start()
    try:
        busy = served.client.with_options(base_url=server.url + "/v1")
        kw = dict(model=NAME, prompt=PROMPTS[0], max_tokens=100, extra_body={"ignore_eos": True})
        streams = [busy.completions.create(**kw, stream=True, temperature=0) for _ in range(4)]
        streams.append(busy.completions.create(**kw, stream=True, n=4, temperature=1.0))
        status, headers, got = request(server.url, "/v1/completions", {"prompt": "x"})
        assert status == 503 and headers["Retry-After"] == "1"
        assert "--max-waiting-requests 0" in got["error"]["message"]
        for s in streams:
            s.close()
        wait_idle(server.url)
        assert request(server.url, "/v1/completions", {"prompt": "x", "max_tokens": 2})[0] == 200
    finally:
        server.stop()


# -- the rest of the API -----------------------------------------------------------------------


def test_models_tokenize_detokenize_and_metrics(served):
    url = served.url
    models = served.client.models.list()
    assert [m.id for m in models.data] == [NAME]
    assert extra(models.data[0], "max_model_len") == 128
    tok = served.llm.get_tokenizer()
    status, _, got = request(url, "/tokenize", {"prompt": PROMPTS[0]})
    assert status == 200 and got["tokens"] == tok.encode(PROMPTS[0], add_bos=True)
    assert got["count"] == len(got["tokens"]) and got["max_model_len"] == 128
    status, _, got = request(url, "/detokenize", {"tokens": got["tokens"]})
    assert status == 200 and got["prompt"] == PROMPTS[0]
    status, _, got = request(url, "/detokenize", {"tokens": [1, 99999]})
    assert status == 400 and "99999" in got["error"]["message"]
    served.client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=4)
    _, _, text = request(url, "/metrics", key=None)
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
        "prompt_tokens_total",
        "generation_tokens_total",
        "request_success_total",
        "time_to_first_token_seconds_count",
        "inter_token_latency_seconds_count",
        "e2e_request_latency_seconds_count",
        "spec_decode_num_draft_tokens_total",
        "spec_decode_num_accepted_tokens_total",
    ):
        assert re.search(rf"^dsv4:{name}\{{", text, re.M), name
    st = served.llm.llm_engine.stats
    assert metric(url, "generation_tokens_total") == st.num_generation_tokens
    assert metric(url, "prompt_tokens_total") == st.num_prompt_tokens
    assert metric(url, "prefix_cache_hits_total") == st.prefix_cache_hits
    assert metric(url, "e2e_request_latency_seconds_count") >= 1
    assert compilation_count() == served.compilations  # every test above included


def test_stop_drains_running_requests_then_refuses_new_ones(served):
    """`ServerThread.stop` (SIGTERM's path): the stream that runs finishes whole, /health
    turns 503 meanwhile, the listener closes, and the driver keeps serving other apps."""
    (ref,) = served.offline(PROMPTS[2], temperature=0, max_tokens=40, ignore_eos=True)
    app = build_app(served.llm, served.driver, ServerOptions(NAME))
    server = ServerThread(app, shutdown_timeout=60).start()
    client = served.client.with_options(base_url=server.url + "/v1")
    kw = dict(model=NAME, prompt=PROMPTS[2], max_tokens=40, temperature=0)
    kw["extra_body"] = {"ignore_eos": True}
    stream = client.completions.create(**kw, stream=True)
    text = next(iter(stream)).choices[0].text
    stopper = threading.Thread(target=server.stop)
    stopper.start()
    deadline = time.monotonic() + 10
    while not app.state.serving.draining and time.monotonic() < deadline:
        time.sleep(0.02)
    assert app.state.serving.draining
    text += "".join(c.choices[0].text for c in stream)
    stopper.join(60)
    assert text == ref.outputs[0].text and not server.thread.is_alive()
    with pytest.raises(openai.APIConnectionError):
        client.completions.create(**kw)
    assert served.client.completions.create(**kw).choices[0].text == ref.outputs[0].text


class FaultyDriver:
    """The served driver, except that each request's sink gets ``fault`` in place of its
    ``after``-th output and nothing after it (as an engine failure reaches a waiting client)."""

    def __init__(self, driver: EngineDriver, fault, after: int = 3) -> None:
        self.driver, self.fault, self.after = driver, fault, after

    def add(self, request_id, token_ids, params, sink, *, prompt=None) -> None:
        count = iter(range(1, 1 << 30))

        def faulty(item) -> None:
            n = next(count)
            if n <= self.after:
                sink(item if n < self.after else self.fault)

        self.driver.add(request_id, token_ids, params, faulty, prompt=prompt)

    def __getattr__(self, name):
        return getattr(self.driver, name)


class LateDriver(FaultyDriver):
    """The served driver, except that a request's outputs reach the server all at once when it
    finishes (as a busy event loop finds a step's outputs waiting)."""

    def __init__(self, driver: EngineDriver) -> None:
        super().__init__(driver, None)

    def add(self, request_id, token_ids, params, sink, *, prompt=None) -> None:
        held: list = []

        def late(item) -> None:
            held.append(item)
            if not hasattr(item, "finished") or item.finished:
                for x in held:
                    sink(x)

        self.driver.add(request_id, token_ids, params, late, prompt=prompt)


def sse_lines(url: str, body: dict) -> list[str]:
    """The ``data:`` payloads of a streamed completion, read to the end of the response."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}), headers)
    resp = conn.getresponse()
    assert resp.status == 200
    lines = [x.decode().removeprefix("data: ").strip() for x in resp.read().splitlines()]
    conn.close()
    return [x for x in lines if x]


def test_an_error_once_a_stream_began_ends_it_with_an_error_chunk_then_done(served):
    """An engine failure reaching a running stream (and a fault of the server's own: an output
    it cannot read) ends the stream as vLLM's do: the chunks so far, an error chunk in OpenAI's
    shape, ``data: [DONE]``; not a cut connection. The request is aborted and its blocks
    freed; the `openai` client raises the error's message."""
    body = dict(model=NAME, prompt=PROMPTS[0], max_tokens=40, temperature=0, ignore_eos=True)
    for fault, message in ((RuntimeError("boom"), "the engine failed: RuntimeError('boom')"),
                           (object(), "the server failed: AttributeError")):  # fmt: skip
        app = build_app(served.llm, FaultyDriver(served.driver, fault), ServerOptions(NAME))
        server = ServerThread(app).start()
        try:
            *chunks, error, done = sse_lines(server.url, body)
            assert done == "[DONE]" and len(chunks) >= 1
            assert all(json.loads(c)["choices"][0]["finish_reason"] is None for c in chunks)
            error = json.loads(error)["error"]
            assert error["code"] == 500 and error["type"] == "internal_server_error"
            assert error["message"].startswith(message), error
            wait_idle(served.url)
            client = served.client.with_options(base_url=server.url + "/v1")
            kw = {k: v for k, v in body.items() if k != "ignore_eos"}
            stream = client.completions.create(**kw, stream=True, extra_body={"ignore_eos": True})
            with pytest.raises(openai.APIError, match=re.escape(message)):
                list(stream)
            wait_idle(served.url)
        finally:
            server.stop()


def test_outputs_found_waiting_together_are_sent_as_one_chunk(served):
    """Outputs are cumulative: when several of a request's wait at once, the server sends what
    the last one adds (one chunk per choice), and the stream still equals `LLM.generate`."""
    (ref,) = served.offline(PROMPTS[0], n=2, temperature=0.8, seed=3, max_tokens=12)
    app = build_app(served.llm, LateDriver(served.driver), ServerOptions(NAME))
    server = ServerThread(app).start()
    try:
        body = dict(model=NAME, prompt=PROMPTS[0], n=2, temperature=0.8, seed=3, max_tokens=12)
        *chunks, done = sse_lines(server.url, body)
        assert done == "[DONE]" and len(chunks) == 2
        got = sorted((c["index"], c["text"]) for x in chunks for c in json.loads(x)["choices"])
        assert got == [(c.index, c.text) for c in ref.outputs]
    finally:
        server.stop()


def test_malformed_json_and_a_wrong_typed_field_are_400_naming_what(served):
    status, _, got = request(served.url, "/v1/completions", raw=b'{"prompt": "x", ')
    assert status == 400 and got["error"]["code"] == 400
    assert got["error"]["message"].startswith("malformed JSON in the request body at character")
    for path, body, field in (
        ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "stream": [1]}, "stream"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}], "top_logprobs": "x"},
         "top_logprobs"),
    ):  # fmt: skip
        status, _, got = request(served.url, path, body)
        assert status == 400 and got["error"]["param"] == field, got
        assert got["error"]["message"].startswith(field) and "got" in got["error"]["message"]


# -- without a tokenizer, with drafts ----------------------------------------------------------


@pytest.fixture(scope="module")
def ids_only(served, shipped_llm_args, tmp_path_factory):
    """A second server over the shipped model's weights in a folder without a tokenizer (its
    config and weights only), `LLM(..., skip_tokenizer_init=True)` with n-gram drafts; same
    sizes as the session's LLM."""
    folder = tmp_path_factory.mktemp("no_tokenizer")
    for name in ("config.json", "model.safetensors"):
        os.symlink(os.path.join(shipped_checkpoint("tiny_v41_trained"), name), folder / name)
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1}
    with jax.default_matmul_precision("highest"):  # as the driver runs it
        llm = LLM(str(folder), **shipped_llm_args, skip_tokenizer_init=True,
                  speculative_config=spec)  # fmt: skip
    s = Served(llm)
    yield s
    s.server.stop()
    s.driver.stop(timeout=30)


def code_ids(served, text: str) -> list[int]:
    return served.llm.get_tokenizer().encode(text, add_bos=True)


def test_skip_tokenizer_init_llm_takes_and_gives_token_ids_only(served, ids_only):
    """`LLM(FOLDER, skip_tokenizer_init=True)` on a model folder without a tokenizer loads none:
    a text prompt and chat are refused naming why; token-id prompts give the tokens (and
    logprobs) the shipped LLM with its tokenizer gives, with empty text. The EOS is still the
    model's: generation stops at it."""
    llm = ids_only.llm
    assert llm.get_tokenizer() is None and llm.engine.eos_token_id == llm.cfg.eos_token_id
    with pytest.raises(ValueError, match=r"prompts\[0\]: a text prompt needs a tokenizer.*ids"):
        llm.generate("def f():", use_tqdm=False)
    with pytest.raises(ValueError, match="messages: chat needs a tokenizer"):
        llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)
    with pytest.raises(ValueError, match="skip_tokenizer_init='yes' is not allowed: True or"):
        LLM("tiny_v41_trained", skip_tokenizer_init="yes")  # refused before anything loads
    # the second prompt's first token is the EOS (the shipped model ends a script there)
    prompts = [
        code_ids(served, t) for t in (PROMPTS[1], 'if __name__ == "__main__":\n    main()\n')
    ]
    ref = served.offline(prompts, temperature=0, max_tokens=12, logprobs=1)
    assert ref[1].outputs[0].finish_reason == "stop"  # the ids-only LLM must know the EOS too
    got = ids_only.offline(prompts, temperature=0, max_tokens=12, logprobs=1)
    for g, r in zip(got, ref, strict=True):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids and g.outputs[0].text == ""
        assert g.prompt is None and g.outputs[0].finish_reason == r.outputs[0].finish_reason
        for a, b in zip(g.outputs[0].logprobs, r.outputs[0].logprobs, strict=True):
            assert {t: x.logprob for t, x in a.items()} == pytest.approx(
                {t: x.logprob for t, x in b.items()}, abs=1e-5
            )
            assert all(x.decoded_token is None for x in a.values())


def test_skip_tokenizer_init_server_takes_and_returns_token_ids(served, ids_only):
    """The server reads the LLM's setting: token-id prompts, token ids in every choice (no
    text), logprob tokens as vLLM writes them without a tokenizer (``token_id:N``), streamed
    and not; text prompts, chat, /tokenize and /detokenize are 400s naming why."""
    prompt = code_ids(served, PROMPTS[2])
    (ref,) = served.offline([prompt], temperature=0, max_tokens=8, logprobs=1)
    want = ref.outputs[0]
    body = {"model": NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 1}
    status, _, got = request(ids_only.url, "/v1/completions", body)
    choice = got["choices"][0]
    assert status == 200 and choice["text"] == "" and choice["token_ids"] == want.token_ids
    assert choice["prompt_token_ids"] == prompt
    lp = choice["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in want.token_ids]
    assert lp["token_logprobs"] == pytest.approx(
        [e[t].logprob for t, e in zip(want.token_ids, want.logprobs)], abs=1e-5
    )
    assert [set(top) for top in lp["top_logprobs"]] == [
        {f"token_id:{t}" for t in e} for e in want.logprobs
    ]
    streamed = [json.loads(x) for x in sse_lines(ids_only.url, body)[:-1]]
    assert [t for c in streamed for t in c["choices"][0]["token_ids"]] == want.token_ids
    assert "".join(c["choices"][0]["text"] for c in streamed) == ""
    for path, bad, named in (
        ("/v1/completions", {"prompt": "def f():"}, "prompt='def f():': a text prompt needs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "chat"),
        ("/tokenize", {"prompt": "def f():"}, "/tokenize"),
        ("/detokenize", {"tokens": [5, 6]}, "/detokenize"),
    ):
        status, _, got = request(ids_only.url, path, bad)
        assert status == 400 and got["error"]["message"].startswith(named), got
        assert "--skip-tokenizer-init" in got["error"]["message"]


def test_spec_decode_counters_equal_the_requests_own_draft_counts(served, ids_only):
    """With n-gram drafts, /metrics' drafted and accepted token counters grow by exactly what
    the requests of the run report drafted and accepted (`RequestOutput.metrics`, counted per
    request as its steps verify): both positive; the tokens equal decoding without drafts."""
    url = ids_only.url
    prompts = [code_ids(served, PROMPTS[i % 3] * (1 + i % 2)) for i in range(6)]
    want = served.offline(prompts, temperature=0, max_tokens=24, ignore_eos=True)
    finished: list = []
    ids_only.driver.call_when_idle(
        lambda: ids_only.driver.observers.append(
            lambda _, outs: finished.extend(o for o in outs if o.finished)
        )
    ).result(timeout=60)
    before = {k: metric(url, f"spec_decode_num_{k}_tokens_total") for k in ("draft", "accepted")}

    def one(prompt):
        body = {"model": NAME, "prompt": prompt, "max_tokens": 24, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        return request(url, "/v1/completions", body)[2]["choices"][0]["token_ids"]

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(one, prompts))
    assert got == [o.outputs[0].token_ids for o in want]
    assert len(finished) == len(prompts)
    drafted = sum(o.metrics.spec_num_draft_tokens for o in finished)
    accepted = sum(o.metrics.spec_num_accepted_tokens for o in finished)
    assert drafted > 0 and accepted > 0
    assert metric(url, "spec_decode_num_draft_tokens_total") - before["draft"] == drafted
    assert metric(url, "spec_decode_num_accepted_tokens_total") - before["accepted"] == accepted

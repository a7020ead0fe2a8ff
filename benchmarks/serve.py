"""``dsv4 serve`` against `LLM.generate`: N concurrent streaming clients over HTTP on 127.0.0.1
(a minimal HTTP/1.1 client on asyncio streams, each event's JSON parsed, as load generators
read them), and the same prompts through `LLM.generate` on the same engine.

Prints one JSON line: output tokens/s of both, their ratio (the goal: HTTP at least 0.85 of
offline on the shipped model), and over HTTP TTFT and inter-token latency p50 / p99 (ms).
``--table`` prints the README's row instead. Fields: docs/benchmarks.md#benchmarksserve.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import multiprocessing
import platform
import time
from collections.abc import Sequence

from benchmarks import at_least_one

GOAL = 0.85  # HTTP tokens/s over offline tokens/s, on the shipped model


def _percentiles(values: Sequence[float]) -> dict[str, float | None]:
    import numpy as np

    if not values:
        return {"p50": None, "p99": None}
    arr = np.asarray(values) * 1000
    return {f"p{q}": round(float(np.percentile(arr, q)), 3) for q in (50, 99)}


async def _post_stream(host: str, port: int, path: str, body: dict):
    """POST ``body`` as JSON over HTTP/1.1 and yield each Server-Sent Event's data as it
    arrives: a minimal client on asyncio streams (chunked transfer decoding, events split on
    blank lines), so that the load generator's own CPU time stays small beside the server's on
    the cores they share."""
    payload = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        status = await reader.readline()
        headers = (await reader.readuntil(b"\r\n\r\n")).lower()
        if b" 200 " not in status or b"transfer-encoding: chunked" not in headers:
            raise RuntimeError(f"the server answered {status.decode().strip()!r}, not a stream")
        pending = b""
        while size := int((await reader.readline()).split(b";")[0], 16):
            pending += (await reader.readexactly(size + 2))[:-2]
            *events, pending = pending.split(b"\n\n")
            for event in events:
                if event.startswith(b"data: "):
                    yield event[6:]
    finally:
        writer.close()


async def _client(url: str, model: str, prompt: list[int], max_tokens: int):
    """One streaming request: (tokens, TTFT, the gaps between its chunks per token), each
    event's JSON parsed as vLLM's serving benchmark parses it."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    t0 = time.perf_counter()
    tokens, ttft, gaps, last = 0, None, [], None
    async for data in _post_stream(host, int(port), "/v1/completions", body):
        if data == b"[DONE]":
            break
        now = time.perf_counter()
        chunk = json.loads(data)
        if "error" in chunk:
            raise RuntimeError(f"the server ended a stream with an error: {chunk['error']}")
        new = len(chunk["choices"][0].get("token_ids") or [])
        if not new:
            continue
        if ttft is None:
            ttft = now - t0
        elif last is not None:
            gaps += [(now - last) / new] * new
        tokens, last = tokens + new, now
    return tokens, ttft, gaps


async def _http_round(url: str, model: str, prompts, max_tokens: int):
    return await asyncio.gather(*(_client(url, model, p, max_tokens) for p in prompts))


def _clients(url: str, model: str, prompts, max_tokens: int, repeats: int):
    """A warm-up round, then the fastest of ``repeats`` timed ones: (results, seconds). It runs
    in its own process, as load generators do, so that parsing the streams does not take the
    server's interpreter."""
    asyncio.run(_http_round(url, model, prompts, max_tokens))
    best = (None, float("inf"))
    for _ in range(repeats):
        t0 = time.perf_counter()
        results = asyncio.run(_http_round(url, model, prompts, max_tokens))
        best = min(best, (results, time.perf_counter() - t0), key=lambda r: r[1])
    return best


# why: one engine for both sides, the offline rounds, the server and its client process
def run(
    model: str,
    clients: int,
    prompt_tokens: int,
    max_tokens: int,
    max_model_len: int,
    repeats: int = 3,
    **engine,
) -> dict:
    """Offline then HTTP (each after one warm-up round, the fastest of ``repeats`` rounds),
    same prompts, same engine; ``engine``: more `LLM` keywords."""
    from benchmarks.speculative import heldout_prefixes
    from serving import LLM, SamplingParams
    from serving.engine_driver import EngineDriver
    from serving.server import ServerOptions, ServerThread, build_app

    llm = LLM(model, max_num_seqs=clients, max_model_len=max_model_len, **engine)
    prompts = heldout_prefixes(llm.get_tokenizer(), prompt_tokens, clients)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts, sp, use_tqdm=False)  # the same warm-up the HTTP round gets
    offline_s = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        offline_s = min(offline_s, time.perf_counter() - t0)
    offline_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    driver = EngineDriver(llm.llm_engine).start()
    server = ServerThread(build_app(llm, driver, ServerOptions(model))).start()
    try:
        spawn = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
            job = pool.submit(_clients, server.url, model, prompts, max_tokens, repeats)
            results, http_s = job.result()
    finally:
        server.stop()
        driver.stop(timeout=60)
    http_tokens = sum(r[0] for r in results)
    offline_rate, http_rate = offline_tokens / offline_s, http_tokens / http_s
    return {
        "benchmark": "serve",
        "model": model,
        "clients": clients,
        "prompt_tokens": prompt_tokens,
        "max_tokens": max_tokens,
        "repeats": repeats,
        "offline_output_tokens_per_s": round(offline_rate, 2),
        "http_output_tokens_per_s": round(http_rate, 2),
        "http_over_offline": round(http_rate / offline_rate, 3),
        "goal": GOAL,
        "http_ttft_ms": _percentiles([r[1] for r in results if r[1] is not None]),
        "http_itl_ms": _percentiles([g for r in results for g in r[2]]),
        "same_tokens": http_tokens == offline_tokens,
        "python": platform.python_version(),
    }


def table_row(result: dict) -> str:
    """The README's line for ``result``."""
    ttft, itl = result["http_ttft_ms"], result["http_itl_ms"]
    return (
        f"Serving over HTTP ({result['clients']} streaming clients, {result['model']}, "
        f"`python -m benchmarks.serve --table`): **{result['http_output_tokens_per_s']}** output "
        f"tokens/s against {result['offline_output_tokens_per_s']} through `LLM.generate` "
        f"(ratio {result['http_over_offline']}, goal {GOAL}); TTFT p50 {ttft['p50']} ms, p99 "
        f"{ttft['p99']} ms; inter-token latency p50 {itl['p50']} ms, p99 {itl['p99']} ms."
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serve", description=__doc__)
    parser.add_argument("--model", default="tiny_v41_trained")
    parser.add_argument("--clients", type=int, default=16, help="concurrent streams (16)")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (the fastest)")
    parser.add_argument("--table", action="store_true", help="the README's line")
    args = parser.parse_args(argv)
    at_least_one(parser, args, "clients", "prompt_tokens", "max_tokens", "repeats")
    if args.prompt_tokens + args.max_tokens > args.max_model_len:
        parser.error("--prompt-tokens + --max-tokens must be at most --max-model-len")
    sizes = (args.clients, args.prompt_tokens, args.max_tokens, args.max_model_len, args.repeats)
    result = run(args.model, *sizes)
    print(table_row(result) if args.table else json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``dsv4 serve``: its flags (every engine flag of ``dsv4 generate``, same names and defaults),
bad values refused before anything starts, and SIGTERM on a real server process: it prints where
it listens once ready, finishes the stream that runs, refuses new connections and exits 0."""

from __future__ import annotations

import argparse
import http.client
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from serving.cli import build_parser

REPO = Path(__file__).resolve().parents[2]


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _flags(parser: argparse.ArgumentParser) -> dict[str, object]:
    return {s: a.default for a in parser._actions for s in a.option_strings}


def test_serve_takes_every_engine_flag_of_generate_with_its_default():
    serve, generate = _flags(_subparser("serve")), _flags(_subparser("generate"))
    sampling = {"--max-tokens", "--temperature", "--top-p", "--top-k", "--prompt", "--n"}
    engine = {f: d for f, d in generate.items() if f not in sampling | {"--logprobs"}}
    assert {f: serve.get(f, "missing") for f in engine} == engine
    for flag in ("--host", "--port", "--api-key", "--served-model-name", "--skip-tokenizer-init",
                 "--max-waiting-requests", "--shutdown-timeout"):  # fmt: skip
        assert flag in serve
    assert (serve["--host"], serve["--port"]) == ("127.0.0.1", 8000)


def test_skip_tokenizer_init_is_one_engine_flag_for_generate_and_serve(usage_error):
    """--skip-tokenizer-init is `ModelConfig.skip_tokenizer_init`'s flag (defined once, with the
    engine's): `dsv4 serve` hands it to the LLM; the text commands refuse it, naming why."""
    from serving.cli_llm import engine_config

    flags = [a.option_strings for a in _subparser("serve")._actions]
    assert sum("--skip-tokenizer-init" in f for f in flags) == 1
    args = build_parser().parse_args(["serve", "--skip-tokenizer-init"])
    assert engine_config(args).model_config.skip_tokenizer_init is True
    assert (
        engine_config(build_parser().parse_args(["serve"])).to_kwargs()["skip_tokenizer_init"]
        is False
    )
    for argv in (["generate", "--prompt", "def f():"], ["demo"]):
        _, err = usage_error([*argv, "--skip-tokenizer-init"])
        assert "--skip-tokenizer-init: this command works on text" in err, err


def test_serve_steps_one_at_a_time_unless_asked():
    """`dsv4 serve` runs one step a program (`LLM` alone would run bursts of decode steps,
    which a stream would get in chunks); ``--num-scheduler-steps`` still sets bursts."""
    from serving.cli import serve_kwargs
    from serving.cli_llm import engine_config

    def steps(*argv):
        return serve_kwargs(engine_config(build_parser().parse_args(["serve", *argv])))[
            "num_scheduler_steps"
        ]

    assert steps() == 1 and steps("--num-scheduler-steps", "4") == 4
    generate = build_parser().parse_args(["generate", "--prompt", "x"])
    assert engine_config(generate).scheduler_config.num_scheduler_steps is None  # LLM decides


def test_api_key_defaults_to_the_environment(monkeypatch, capsys):
    from serving.cli import api_key

    monkeypatch.setenv("DSV4_API_KEY", "from-env")
    assert api_key(build_parser().parse_args(["serve"])) == "from-env"
    assert api_key(build_parser().parse_args(["serve", "--api-key", "flag"])) == "flag"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    assert "from-env" not in capsys.readouterr().out  # the key never shows in --help
    monkeypatch.delenv("DSV4_API_KEY")
    assert api_key(build_parser().parse_args(["serve"])) is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--port", "70000"], "--port 70000: must be in 0..65535"),
        (["--max-waiting-requests", "-1"], "--max-waiting-requests -1: must be >= 0"),
        (["--shutdown-timeout", "-2"], "--shutdown-timeout -2.0: must be >= 0"),
        (["tiny_v41", "--model", "tiny_v41_trained"], "disagree"),
        (["--max-num-seqs", "0"], "--max-num-seqs 0"),
        (["/no/such/dir"], "/no/such/dir"),
    ],
)
def test_bad_serve_flags_fail_before_anything_starts(usage_error, argv, message):
    _, err = usage_error(["serve", *argv])
    assert message in err, err


ENGINE = ["--max-model-len", "128", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
          "--token-buckets", "64", "--num-gpu-blocks", "200", "--no-compilation-cache"]  # fmt: skip


def _lines(stream, out: queue.Queue) -> None:
    for line in stream:
        out.put(line)
    out.put(None)


@pytest.mark.slow  # ~25 s (a fresh process compiles); the in-process drain test runs by default
def test_sigterm_finishes_the_running_stream_and_exits_0():
    cmd = [sys.executable, "-m", "serving.cli", "serve", "tiny_v41_trained", "--port", "0",
           "--shutdown-timeout", "60", *ENGINE]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_lines, args=(proc.stdout, lines), daemon=True).start()
    try:
        url = None
        while url is None:
            line = lines.get(timeout=240)
            assert line is not None, "the server exited before it was ready"
            if "ready, listening on http://" in line:
                url = line.rsplit("http://", 1)[1].strip()
        host, port = url.split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
        body = {"prompt": "def main():", "max_tokens": 40, "temperature": 0, "stream": True}
        body.update(ignore_eos=True, return_token_ids=True)
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        events = [resp.readline()]
        proc.send_signal(signal.SIGTERM)
        events += resp.read().splitlines()
        data = [e[6:] for e in events if e.startswith(b"data: ")]
        assert data[-1] == b"[DONE]"
        tokens = [t for d in data[:-1] for t in json.loads(d)["choices"][0]["token_ids"]]
        assert len(tokens) == 40
        assert proc.wait(timeout=60) == 0
        with pytest.raises(ConnectionRefusedError):
            http.client.HTTPConnection(host, int(port), timeout=5).request("GET", "/health")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

"""The `dsv4` command line: the README's demo runs chats through LLM.generate (prefix hits,
TTFT, tokens/s), `generate` prints outputs for the tiny random model and for a checkpoint
directory with its tokenizer.json, `bench` prints one JSON line, bad arguments fail with clear
messages before anything expensive runs, and the allocator demo and the layout report still
say something true.

The model commands share one engine configuration (`ENGINE` below), so they compile once.
"""

from __future__ import annotations

import itertools
import json
import re
import tomllib
from pathlib import Path

import pytest

from serving.cli import main
from serving.cli_llm import DEMO_QUESTIONS, DEMO_SYSTEM

ENGINE = [
    "--model", "tiny_v41", "--max-model-len", "256", "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
    "--token-buckets", "32", "--num-gpu-blocks", "64", "--max-logprobs", "5",
    "--no-compilation-cache",
]  # fmt: skip


def _demo_requests(out: str) -> list[dict]:
    """The demo's per-request lines: figures, then the prompt beside the completion."""
    pattern = (
        r"\[(\d)\] (\d+) prompt tokens \((\d+) from the prefix cache\); time to first token "
        r"([\d.]+) ms, time per output token ([\d.]+) ms; (\d+) output tokens \((\w+)\)\n"
        r"    prompt     > (.*)\n((?:               > .*\n)*)"
        r"    completion \| (.*)\n?((?:               \| .*\n?)*)"
    )
    keys = ("index", "prompt_tokens", "hit", "ttft_ms", "tpot_ms", "tokens", "finish",
            "prompt", "prompt_more", "completion", "completion_more")  # fmt: skip
    return [dict(zip(keys, m.groups(), strict=True)) for m in re.finditer(pattern, out)]


def _demo_completion(request: dict) -> str:
    more = [line[17:] for line in request["completion_more"].splitlines()]
    return "\n".join([request["completion"], *more])


def test_demo_runs_chats_through_llm_generate(capsys):
    assert main(["demo", *ENGINE, "--max-tokens", "6"]) == 0
    out, err = capsys.readouterr()
    assert "tiny_v41 with random weights (seed 0)" in out and "gibberish" in out
    assert "tokenizer byte-level (built-in)" in out and "async scheduling" in out
    warm = re.search(r"warm-up [\d.]+ s: (\d+) programs \((\d+) compiled, (\d+) loaded", out)
    assert warm and int(warm.group(1)) >= 2 and warm.group(3) == "0"  # --no-compilation-cache
    # (a program this process compiled before, for another test, is neither compiled nor loaded)
    assert int(warm.group(2)) <= int(warm.group(1))
    bar = re.findall(r"warm-up: step programs: 100%\|.*?\| (\d+)/(\d+)", err)
    assert bar and bar[-1] == (warm.group(1), warm.group(1)), "the bar counts those programs"
    assert "    > " + DEMO_SYSTEM.splitlines()[0] in out  # the shared header, once
    rounds = re.findall(r"-- round (\d): ", out)
    assert rounds == ["1", "2"]
    requests = _demo_requests(out)
    assert len(requests) == 2 * len(DEMO_QUESTIONS)
    first, second = requests[: len(DEMO_QUESTIONS)], requests[len(DEMO_QUESTIONS) :]
    for i, (request, question) in enumerate(zip(first, DEMO_QUESTIONS, strict=True)):
        assert request["index"] == str(i) and int(request["tokens"]) == 6
        shown = [request["prompt"]] + [ln[17:] for ln in request["prompt_more"].splitlines()]
        assert "\n".join(shown) == question, "each prompt beside its completion"
        assert request["completion"].startswith("'") and float(request["ttft_ms"]) > 0
    assert all(int(r["hit"]) > 0 for r in second), "round 2 resends round 1: it must hit"
    total = re.search(r"total: (\d+) output tokens .* = ([\d.]+) tokens/s; prefix-cache hit "
                      r"rate ([\d.]+) % \((\d+) of (\d+) prompt tokens\)", out)  # fmt: skip
    assert total and int(total.group(1)) == 6 * len(requests) and float(total.group(2)) > 0
    hits, queries = int(total.group(4)), int(total.group(5))
    assert hits == sum(int(r["hit"]) for r in requests)
    assert queries == sum(int(r["prompt_tokens"]) for r in requests)
    assert float(total.group(3)) == pytest.approx(100 * hits / queries, abs=0.05)
    assert "0 compilations after warm-up" in out


def test_demo_defaults_to_the_shipped_trained_model(capsys):
    # ENGINE's sizes, the default model: the README's `make demo`
    argv = [a for a in ENGINE if a != "tiny_v41"]
    argv.remove("--model")
    assert main(["demo", *argv, "--max-tokens", "16"]) == 0
    out = capsys.readouterr().out
    assert "tiny_v41_trained, the shipped small V4.1" in out and "gibberish" not in out
    assert "tokenizer tokenizer.json" in out
    # its size as the docs give it: the backbone, and the DSpark drafter (mtp.*) apart
    from dsv4.checkpoint import load_pretrained

    _, params = load_pretrained("tiny_v41_trained", progress=False)
    drafter = sum(x.size for name, x in params.items() if name.startswith("mtp."))
    backbone = sum(x.size for x in params.values()) - drafter
    assert f"model: {backbone:,} parameters (and {drafter:,} in its DSpark drafter), " in out
    requests = _demo_requests(out)
    assert len(requests) == 2 * len(DEMO_QUESTIONS)
    text = "\n".join(_demo_completion(r) for r in requests)
    assert len(text) > 100
    # readable: printable ASCII, whitespace and words, as the standard library is written
    assert sum(ch.isprintable() or ch in "\n\t" for ch in text) / len(text) > 0.99
    assert re.search(r"[A-Za-z_]{3,}", text)
    assert "0 compilations after warm-up" in out


def test_make_demo_installs_what_dsv4_lab_needs():
    """`make demo` installs the lab extra, so that `dsv4 lab`, whose plots need matplotlib
    (tests/lab runs it), works right after it."""
    root = Path(__file__).resolve().parents[2]
    make = (root / "Makefile").read_text(encoding="utf-8")
    assert re.search(r"^demo: \$\(VENV\)/\.installed-main$", make, re.M)
    recipe = re.search(r"^\$\(VENV\)/\.installed-main:.*\n\t(.*)$", make, re.M)
    extras = re.search(r"pip install .*-e '\.\[([\w,]+)\]'", recipe.group(1))
    assert extras, f"the demo installs no extra: {recipe.group(1)}"
    pyproject = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))
    optional = pyproject["project"]["optional-dependencies"]
    installed = [dep for extra in extras.group(1).split(",") for dep in optional[extra]]
    assert "matplotlib" in installed


def test_generate_prints_outputs_with_logprobs_and_n(capsys):
    argv = ["generate", *ENGINE, "--prompt", "The quick brown fox", "--prompt", "DeepSeek"]
    assert main([*argv, "--max-tokens", "5", "--logprobs", "2"]) == 0
    out = capsys.readouterr().out
    assert "[0] prompt: 'The quick brown fox' (20 tokens)" in out
    assert len(re.findall(r"output: .* \(\d+ tokens, (length|stop)\)", out)) == 2
    assert len(re.findall(r"logprobs: \[", out)) == 2 and "TTFT" in out
    assert main([*argv, "--max-tokens", "3", "--n", "2", "--temperature", "0.9"]) == 0
    out = capsys.readouterr().out
    assert len(re.findall(r"output #[01]: ", out)) == 4


def test_bench_prints_one_json_line(capsys):
    argv = ["bench", *ENGINE, "--conversations", "3", "--turns", "2", "--max-tokens", "4"]
    assert main(argv) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    result = json.loads(line)
    assert result["requests"] == 6 and result["output_tokens"] == 24
    assert result["output_tokens_per_s"] > 0 and result["prefix_cache_hit_rate"] > 0
    assert set(result["ttft_ms"]) == {"p50", "p90", "p99"}
    assert result["compilations_after_warm_up"] == 0
    # decode steps in bursts of up to 4: the same tokens
    assert main([*argv, "--num-scheduler-steps", "4"]) == 0
    burst = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert burst["num_scheduler_steps"] == 4 and burst["output_tokens"] == 24
    assert burst["compilations_after_warm_up"] == 0
    # two data shards (each its own scheduler and KV cache) serve the same workload
    assert main([*argv, "--data-parallel-size", "2"]) == 0
    shards = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert shards["requests"] == 6 and shards["output_tokens"] == 24
    assert shards["compilations_after_warm_up"] == 0 and shards["prefix_cache_hit_rate"] > 0


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """tiny_v41's seeded random params saved in the released format, with a byte-level
    tokenizer.json (no merges: one token per byte) and a tokenizer_config.json."""
    import jax

    from dsv4.checkpoint import save_pretrained
    from dsv4.config import tiny_v41
    from dsv4.params import init_params

    path = tmp_path_factory.mktemp("tiny_ckpt")
    cfg = tiny_v41()
    save_pretrained(init_params(cfg, jax.random.PRNGKey(0)), cfg, path)
    _write_byte_level_tokenizer_json(path)
    return path


def _write_byte_level_tokenizer_json(directory) -> None:
    """A tokenizer.json with specials <bos>=0, <eos>=1, <pad>=2 and the 256 byte-level symbols,
    no merges, plus a tokenizer_config.json naming BOS and EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=259,
        special_tokens=["<bos>", "<eos>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["hello world"], trainer)
    assert tok.get_vocab_size() == 259
    tok.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<bos>", "eos_token": "<eos>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def test_generate_from_a_checkpoint_with_its_tokenizer(capsys, tiny_checkpoint):
    argv = ["generate", *ENGINE, "--model", str(tiny_checkpoint), "--prompt", "hello world"]
    assert main([*argv, "--max-tokens", "4", "--temperature", "0.8", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert f"tokenizer tokenizer.json ({tiny_checkpoint}/tokenizer.json)" in out
    assert "[0] prompt: 'hello world' (12 tokens)" in out  # BOS + one token per byte


@pytest.mark.parametrize("command", ["demo", "generate", "bench"])
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-tokens", "0"], "--max-tokens 0: must be >= 1"),
        (["--temperature", "-0.5"], "--temperature -0.5: must be >= 0"),
        (["--temperature", "nan"], "--temperature nan: must be >= 0"),
        (["--top-p", "0"], r"--top-p 0.0: must be in \(0, 1\]"),
        (["--top-p", "1.5"], r"--top-p 1.5: must be in \(0, 1\]"),
        (["--top-k", "-3"], "--top-k -3: must be -1 or 0"),
        (["--max-num-seqs", "0"], "--max-num-seqs 0: must be >= 1"),
        (["--max-num-batched-tokens", "-1"], "--max-num-batched-tokens -1: must be >= 1"),
        (["--max-model-len", "1"], "--max-model-len 1: must be >= 2"),
        (["--num-gpu-blocks", "0"], "--num-gpu-blocks 0: must be >= 2"),
        (["--data-parallel-size", "0"], "--data-parallel-size 0: must be >= 1"),
        (["--num-scheduler-steps", "0"], "--num-scheduler-steps 0: must be >= 1"),
        (["--num-scheduler-steps", "4", "--sync"], "--num-scheduler-steps 4: must be 1 with"),
        (["--token-buckets", "8,x"], "--token-buckets '8,x': comma-separated ints"),
        (["--token-buckets", "8,16"], "--token-buckets '8,16': positive sizes, the largest"),
        (["--model", "/nonexistent/ckpt"], "--model '/nonexistent/ckpt': not a preset"),
        (["--dtype", "float16"], "argument --dtype: invalid choice: 'float16'"),
        (["--max-tokens", "many"], "argument --max-tokens: invalid int value: 'many'"),
    ],
)
def test_model_commands_reject_bad_arguments(usage_error, command, argv, message):
    extra = ["--prompt", "x"] if command == "generate" else []
    _, err = usage_error([command, *extra, *argv])
    assert re.search(f"dsv4 {command}: error: " + message, err), err


@pytest.mark.parametrize(
    ("command", "argv", "message"),
    [
        ("generate", ["--prompt", ""], "--prompt '': must not be empty"),
        ("generate", ["--prompt", "x", "--n", "0"], "--n 0: must be >= 1"),
        ("generate", ["--prompt", "x", "--n", "2"], "--n 2: needs --temperature > 0"),
        (
            "generate",
            ["--prompt", "x", "--logprobs", "-1"],
            r"--logprobs -1: must be in 0\.\.20 \(--max-logprobs 20\)",
        ),
        ("generate", [], "the following arguments are required: --prompt"),
        ("bench", ["--conversations", "0"], "--conversations 0: must be >= 1"),
        ("bench", ["--turns", "0"], "--turns 0: must be >= 1"),
        ("bench", ["--system-tokens", "0"], "--system-tokens 0: must be >= 1"),
        ("bench", ["--user-tokens", "-2"], "--user-tokens -2: must be >= 1"),
        (
            "bench",
            ["--model", "tiny_v41", "--max-model-len", "177", "--turns", "5", "--max-tokens", "2"],
            r"--turns 5: the conversations can reach 178 tokens \(--system-tokens 48 \+ --turns 5 "
            r"x \(--user-tokens 24 \+ --max-tokens 2\)\), more than --max-model-len 177",
        ),
    ],
)
def test_command_specific_arguments_are_checked(usage_error, monkeypatch, command, argv, message):
    import serving.llm

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(serving.llm, "LLM", no_model)  # every refusal comes before a model
    _, err = usage_error([command, *argv])
    assert re.search(f"dsv4 {command}: error: " + message, err)


def test_bench_takes_conversations_that_just_fit():
    """The longest conversation `dsv4 bench` can make (every user message at --user-tokens,
    every output at --max-tokens) fits --max-model-len: its last turn's prompt leaves room for
    its output (the limit the refusal above checks, at the boundary)."""
    from serving.cli import build_parser
    from serving.cli_llm import _check

    argv = ["bench", "--model", "tiny_v41", "--turns", "5", "--max-tokens", "2"]
    _check(build_parser().parse_args([*argv, "--max-model-len", "178"]))  # 48 + 5 x (24 + 2)


def test_model_commands_reject_checkpoints_they_cannot_use(capsys, tmp_path):
    from dsv4.config import tiny_v41

    with pytest.raises(SystemExit):
        main(["generate", "--model", str(tmp_path), "--prompt", "x"])
    assert "no config.json (not a checkpoint directory)" in capsys.readouterr().err

    # no tokenizer.json and a vocabulary too small for the byte tokenizer
    (tmp_path / "config.json").write_text(json.dumps(tiny_v41(vocab_size=200).to_hf_dict()))
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(tmp_path), "--prompt", "x"])
    assert "byte tokenizer needs vocab_size >= 259" in capsys.readouterr().err

    # a config but no weights: the checkpoint loader's error, not a traceback
    (tmp_path / "config.json").write_text(json.dumps(tiny_v41().to_hf_dict()))
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(tmp_path), "--prompt", "x"])
    err = capsys.readouterr().err
    assert "dsv4 generate: error: " in err and "safetensors" in err


_TURN_LINE = re.compile(
    r"conversation (\d+) turn (\d+): prompt\s+(\d+) tokens, hit\s+(\d+) \(\s*\d+%\), "
    r"output\s+(\d+); blocks held per group \[([\d, ]+)\]; pool usage ([\d.]+)%"
)


def _cache_demo_turns(out: str) -> list[dict]:
    return [
        {
            "conv": int(m[0]),
            "turn": int(m[1]),
            "prompt": int(m[2]),
            "hit": int(m[3]),
            "output": int(m[4]),
            "held": [int(x) for x in m[5].split(",")],
            "usage": float(m[6]),
        }
        for m in _TURN_LINE.findall(out)
    ]


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["--bounded-replay"],
        ["--model", "tiny", "--num-speculative-tokens", "3"],
        ["--chunk-tokens", "100", "--max-num-batched-tokens", "256", "--num-blocks", "200"],
    ],
)
def test_cache_demo_runs_and_hits_on_later_turns(capsys, extra):
    assert main(["cache-demo", "--conversations", "2", "--turns", "3", *extra]) == 0
    out = capsys.readouterr().out
    groups = re.search(r"(\d+) KV-cache groups", out)
    assert groups
    turns = _cache_demo_turns(out)
    assert [(t["conv"], t["turn"]) for t in turns] == [(c, k) for c in range(2) for k in range(3)]
    assert turns[0]["hit"] == 0 and all(t["hit"] > 0 for t in turns[1:3])  # reused history
    for t in turns:
        assert 0 <= t["hit"] < t["prompt"], t  # the last prompt token is always computed
        assert 16 <= t["output"] <= 200, t
        assert len(t["held"]) == int(groups[1]) and all(n >= 1 for n in t["held"]), t
        assert 0 < t["usage"] <= 100, t
    for prev, t in itertools.pairwise(turns[:3]):  # conversation 0's history grows turn by turn
        assert t["prompt"] >= prev["prompt"] + prev["output"] + 40
    prompt, hits = sum(t["prompt"] for t in turns), sum(t["hit"] for t in turns)
    assert f"prefix-cache hit rate over 6 turns: {hits / prompt:.1%} of {prompt} prompt" in out


def test_cache_demo_is_deterministic_by_seed(capsys):
    runs = []
    for seed in ("1", "1", "2"):
        assert main(["cache-demo", "--conversations", "1", "--turns", "2", "--seed", seed]) == 0
        runs.append(capsys.readouterr().out)
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_cache_demo_chunked_prefill_keeps_the_hits(capsys):
    """Chunk size and step budget change how prompts are split across steps, not what the
    prefix cache holds for the next turn (full-attention blocks; no window, no replay)."""
    argv = ["cache-demo", "--conversations", "2", "--turns", "2"]
    assert main(argv) == 0
    whole = _cache_demo_turns(capsys.readouterr().out)
    assert main([*argv, "--chunk-tokens", "64", "--max-num-batched-tokens", "128"]) == 0
    chunked = _cache_demo_turns(capsys.readouterr().out)
    assert [t["hit"] for t in chunked] == [t["hit"] for t in whole]
    assert [t["prompt"] for t in chunked] == [t["prompt"] for t in whole]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--conversations", "0"], "--conversations must be >= 1, got 0"),
        (["--conversations", "-2"], "--conversations must be >= 1, got -2"),
        (["--turns", "0"], "--turns must be >= 1, got 0"),
        (["--system-tokens", "-1"], "--system-tokens must be >= 0, got -1"),
        (["--chunk-tokens", "0"], "--chunk-tokens must be >= 1, got 0"),
        (["--num-blocks", "0"], "--num-blocks must be >= 2, got 0"),
        (["--num-blocks", "1"], "--num-blocks must be >= 2, got 1"),
        (
            ["--num-blocks", "100"],
            r"--num-blocks must be >= 606 \(the null block plus what one request of up to 3300 "
            r"tokens takes in the v41_flash layout's 10 groups\), got 100",
        ),
        (["--max-model-len", "0"], "--max-model-len must be >= 1, got 0"),
        (
            ["--max-model-len", "3100"],
            r"--max-model-len must be > 3100 \(the longest prompt: --system-tokens 1500 \+ "
            r"--turns 3 x 400 user tokens \+ 2 x 200 answer tokens\), got 3100",
        ),
        (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be >= 1, got 0"),
        (["--num-speculative-tokens", "-1"], "--num-speculative-tokens must be >= 0, got -1"),
        (["--turns", "many"], "argument --turns: invalid int value: 'many'"),
        (["--model", "huge"], "argument --model: invalid choice: 'huge'"),
    ],
)
def test_cache_demo_rejects_bad_arguments(usage_error, argv, message):
    out, err = usage_error(["cache-demo", *argv])
    assert out == ""  # rejected before any conversation ran
    assert re.search("dsv4 cache-demo: error: " + message, err), err


def test_cache_demo_accepts_the_smallest_pool_it_asks_for(capsys):
    """The --num-blocks bound is enough for the longest conversation the flags allow."""
    with pytest.raises(SystemExit):
        main(["cache-demo", "--num-blocks", "2"])
    need = int(re.search(r"--num-blocks must be >= (\d+)", capsys.readouterr().err)[1])
    for seed in ("0", "1"):
        assert main(["cache-demo", "--num-blocks", str(need), "--seed", seed]) == 0
    assert "prefix-cache hit rate over 9 turns" in capsys.readouterr().out


def test_layout_report(capsys):
    assert main(["layout", "--memory-gib", "4"]) == 0
    out = capsys.readouterr().out
    assert "KV-cache pool:" in out and "MLAAttentionSpec" in out and "per request:" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--memory-gib", "0"], "--memory-gib must be a finite number > 0, got 0.0"),
        (["--memory-gib", "-1"], "--memory-gib must be a finite number > 0, got -1.0"),
        (["--memory-gib", "nan"], "--memory-gib must be a finite number > 0, got nan"),
        (["--memory-gib", "inf"], "--memory-gib must be a finite number > 0, got inf"),
        (
            ["--memory-gib", "0.0001"],
            r"--memory-gib 0.0001 holds no pool block: one block of the v41_flash layout takes "
            r"116928 B",
        ),
        (["--memory-gib", "lots"], "argument --memory-gib: invalid float value: 'lots'"),
        (["--max-model-len", "-5"], "--max-model-len must be >= 1, got -5"),
        (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be >= 1, got 0"),
        (["--num-speculative-tokens", "-1"], "--num-speculative-tokens must be >= 0, got -1"),
    ],
)
def test_layout_rejects_bad_arguments(usage_error, argv, message):
    out, err = usage_error(["layout", *argv])
    assert out == ""
    assert re.search("dsv4 layout: error: " + message, err), err

"""The `dsv4` command line: the README's demo generates text end to end (the tiny random model and
a checkpoint directory with its tokenizer.json), bad arguments fail with clear messages before
anything expensive runs, and the allocator demo and the layout report still say something true.

The two generation tests share one compile: the checkpoint below is the same config as the
random model's and its tokenizer has one token per byte, so the prompt batch has the same shape
and `generate`'s jit cache is hit.
"""

from __future__ import annotations

import json
import re

import pytest

from serving.cli import DEFAULT_PROMPTS, main

NEW = 4


def _generated(out: str) -> list[tuple[str, int]]:
    """(decoded text repr, token count) per prompt, in order."""
    return [(text, int(n)) for text, n in re.findall(r"generated: (.*)  \((\d+) tokens", out)]


def test_demo_generates_with_the_tiny_random_model(capsys):
    assert main(["demo", "--max-new-tokens", str(NEW)]) == 0
    out = capsys.readouterr().out
    assert "tiny_v41 with random weights (seed 0)" in out and "gibberish" in out
    assert re.search(r"model: [\d.]+M parameters \([\d.]+ MB in float32\); 8 layers", out)
    assert "tokenizer: byte-level (built-in)" in out
    # the layer plan, one line per layer, every role present
    for role in ("swa", "full", "reuse", "reindex"):
        assert re.search(rf"layer\s+\d+\s+ratio \d\s+{role}", out), role
    assert "candidate source" in out and "candidate consumer" in out
    # both built-in prompts, batched with their own lengths (BOS + one id per byte)
    lengths = [len(p.encode()) + 1 for p in DEFAULT_PROMPTS]
    assert f"prompt lengths {lengths}" in out
    for i, prompt in enumerate(DEFAULT_PROMPTS):
        assert f"[{i}] prompt:    {prompt!r}" in out
    gen = _generated(out)
    assert len(gen) == 2 and all(1 <= n <= NEW for _, n in gen)
    assert re.search(r"compile: [\d.]+ s \(first call [\d.]+ s, warm call [\d.]+ s\)", out)
    rate = re.search(r"= ([\d.]+) tokens/s", out)
    assert rate and float(rate.group(1)) > 0


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


def test_demo_generates_from_a_checkpoint_with_its_tokenizer(capsys, tiny_checkpoint):
    prompts = list(DEFAULT_PROMPTS)  # given explicitly; same shapes as the first test's batch
    argv = ["demo", "--checkpoint", str(tiny_checkpoint), "--max-new-tokens", str(NEW)]
    for p in prompts:
        argv += ["--prompt", p]
    argv += ["--temperature", "0.8", "--top-p", "0.9", "--seed", "3"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"DeepSeek-V4.1 demo: checkpoint {tiny_checkpoint}" in out
    assert "random weights" not in out
    assert "tokenizer: tokenizer.json" in out
    assert "sampling at temperature 0.8, top-p 0.9" in out
    assert f"prompt lengths {[len(p) + 1 for p in prompts]}" in out
    for i, prompt in enumerate(prompts):
        assert f"[{i}] prompt:    {prompt!r}" in out
    assert len(_generated(out)) == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
        (["--temperature", "-0.5"], "--temperature must be >= 0"),
        (["--temperature", "nan"], "--temperature must be >= 0"),
        (["--top-p", "0"], r"--top-p must be in \(0, 1\], got 0.0"),
        (["--top-p", "1.5"], r"--top-p must be in \(0, 1\], got 1.5"),
        (["--prompt", ""], "--prompt must not be empty"),
        (["--checkpoint", "/nonexistent/ckpt"], "--checkpoint /nonexistent/ckpt: not a directory"),
        (["--dtype", "float16"], "argument --dtype: invalid choice: 'float16'"),
        (["--max-new-tokens", "many"], "argument --max-new-tokens: invalid int value: 'many'"),
        (
            ["--prompt", "x" * 500, "--max-new-tokens", "32"],
            "the longest prompt has 501 tokens; with --max-new-tokens 32 that exceeds the "
            "model's max_seq_len 512",
        ),
    ],
)
def test_demo_rejects_bad_arguments(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        main(["demo", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage: dsv4 demo" in err
    assert re.search("dsv4 demo: error: " + message, err), err


def test_demo_rejects_checkpoints_it_cannot_use(capsys, tmp_path):
    from dsv4.config import tiny_v41

    with pytest.raises(SystemExit):
        main(["demo", "--checkpoint", str(tmp_path)])
    assert "no config.json (not a checkpoint directory)" in capsys.readouterr().err

    # no tokenizer.json and a vocabulary too small for the byte tokenizer
    (tmp_path / "config.json").write_text(json.dumps(tiny_v41(vocab_size=200).to_hf_dict()))
    with pytest.raises(SystemExit):
        main(["demo", "--checkpoint", str(tmp_path)])
    assert "byte tokenizer needs vocab_size >= 259" in capsys.readouterr().err

    # a config but no weights: the checkpoint loader's error, not a traceback
    (tmp_path / "config.json").write_text(json.dumps(tiny_v41().to_hf_dict()))
    with pytest.raises(SystemExit):
        main(["demo", "--checkpoint", str(tmp_path)])
    err = capsys.readouterr().err
    assert "dsv4 demo: error: " in err and "safetensors" in err


@pytest.mark.parametrize(
    "extra", [[], ["--bounded-replay"], ["--model", "tiny", "--num-speculative-tokens", "3"]]
)
def test_cache_demo_runs_and_hits_on_later_turns(capsys, extra):
    assert main(["cache-demo", "--conversations", "2", "--turns", "3", *extra]) == 0
    out = capsys.readouterr().out
    hits = [int(h) for h in re.findall(r"hit\s+(\d+)", out)]
    assert len(hits) == 6
    assert hits[0] == 0 and all(h > 0 for h in hits[1:3])  # later turns reuse the history
    assert "prefix-cache hit rate over 6 turns" in out


def test_layout_report(capsys):
    assert main(["layout", "--memory-gib", "4"]) == 0
    out = capsys.readouterr().out
    assert "KV-cache pool:" in out and "MLAAttentionSpec" in out and "per request:" in out

"""Bad input to `LLM`, the engine and `SamplingParams` is refused with one line naming the value,
where it was (a batch's list index, never an internal request id) and what is allowed; nothing
of a batch runs when any of it is bad, and the engine then serves the next request unchanged
(issue 34). A hypothesis fuzz throws random values at the entry points: each is a clear refusal
or a result equal to `dsv4.generate`'s, never NaN, and the engine never breaks."""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import numpy as np
import pytest
from engine_testing import (
    LLM_ARGS,
    MAX_MODEL_LEN,
    REF_WIDTH,
    TOKEN_BUCKET,
    Arrival,
    assert_pool_is_whole,
    reference_tokens,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving import LLM, SamplingParams
from serving.config import VLLM_ONLY, ConfigError
from serving.sampling_params import BEST_OF_ADVICE, VLLM_ONLY_SAMPLING

GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
GOOD_PROMPT = [3, 17, 200, 41, 5, 9]


@pytest.fixture(scope="module")
def llm():
    with jax.default_matmul_precision("highest"):
        return LLM("tiny_v41", **LLM_ARGS)


def _reference(llm, prompts: list[list[int]], sp: SamplingParams) -> list[list[int]]:
    """Greedy `dsv4.generate` of each prompt (`engine_testing.reference_tokens`, in batches of
    8 as the engine tests', so its compilation is theirs), cut where the engine stops:
    ``max_tokens``, ``max_model_len``, the first stop token."""
    out = []
    for i in range(0, len(prompts), 8):
        chunk = prompts[i : i + 8]
        rows = chunk + [chunk[0]] * (8 - len(chunk))
        arrivals = [Arrival(0, str(r), tuple(p), sp) for r, p in enumerate(rows)]
        with jax.default_matmul_precision("highest"):
            want = reference_tokens(llm.engine.runner.params, llm.cfg, arrivals)
        for r, p in enumerate(chunk):
            row = want[str(r)][: MAX_MODEL_LEN - len(p)]
            stops = [j for j, t in enumerate(row) if t in sp.stop_token_ids]
            out.append(row[: stops[0] + 1] if stops else row)
    return out


def _tokens(llm, prompts, sp=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]


def test_a_bad_prompt_in_a_batch_is_named_by_its_index_and_nothing_runs(llm):
    engine = llm.engine
    steps = engine.stats.num_steps
    cases = [
        (
            [GOOD_PROMPT, GOOD_PROMPT, [5, 512]],
            ValueError,
            r"prompts\[2\]: prompt token 1 is 512, ",
        ),
        ([GOOD_PROMPT, [5, -1]], ValueError, r"prompts\[1\]: prompt token 1 is -1, outside "),
        ([[3, 4.0]], TypeError, r"prompts\[0\]: prompt token 1 is 4\.0; token ids are ints"),
        ([GOOD_PROMPT, np.array([3.0, 4.0])], TypeError, r"prompts\[1\]: .*1-D integer array"),
        ([GOOD_PROMPT, []], ValueError, r"prompts\[1\]: the prompt is empty"),
        (["ok", ""], ValueError, r"prompts\[1\]: the prompt is empty"),
        ([GOOD_PROMPT, [5] * MAX_MODEL_LEN], ValueError, r"prompts\[1\]: the prompt has 128 "),
        ([GOOD_PROMPT, {"text": "x"}], ValueError, r"prompts\[1\]: .*\"prompt_token_ids\""),
        ([GOOD_PROMPT, 7.5], TypeError, r"prompts\[1\]: the prompt must be a list"),
    ]
    for prompts, error, message in cases:
        with pytest.raises(error, match=message):
            llm.generate(prompts, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompts\[0\]: logprobs=6 is not allowed: at most "):
        llm.generate([GOOD_PROMPT], SamplingParams(logprobs=6), use_tqdm=False)
    with pytest.raises(TypeError, match=r"sampling_params\[1\]=3 is not allowed"):
        llm.generate([GOOD_PROMPT, GOOD_PROMPT], [GREEDY, 3], use_tqdm=False)
    assert not engine.has_unfinished_requests() and engine.stats.num_steps == steps
    assert_pool_is_whole(engine)
    # the engine serves the next call as a fresh one would: dsv4.generate's tokens
    good = [GOOD_PROMPT, list(range(3, 30))]
    assert _tokens(llm, good) == _reference(llm, good, GREEDY)


def test_chat_names_the_bad_message(llm):
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    with pytest.raises(ValueError, match=r"messages\[1\]=\{'role': 'user'\} is not allowed"):
        llm.chat([{"role": "user", "content": "a"}, {"role": "user"}], chat_template=template)
    with pytest.raises(ValueError, match=r"messages\[1\]\[0\]=.*is not allowed"):
        llm.chat([[{"role": "user", "content": "a"}], [{"content": 3}]], chat_template=template)
    with pytest.raises(TypeError, match="messages='hi' is not allowed"):
        llm.chat("hi", chat_template=template)


def test_vllm_arguments_are_refused_with_what_to_use_instead():
    with pytest.raises(TypeError, match=r"gpu_memory_utilization=0\.5 .*kv_cache_memory_bytes"):
        LLM("tiny_v41", gpu_memory_utilization=0.5)
    with pytest.raises(TypeError, match=r"tensor_parallel_size=2 .*make_mesh"):
        LLM("tiny_v41", tensor_parallel_size=2)
    for key, advice in VLLM_ONLY.items():  # refused before anything loads
        with pytest.raises(TypeError, match=rf"^{key}=1 \(a vLLM engine argument\) is not "):
            LLM("tiny_v41", **{key: 1})
        _assert_names_exist(key, advice)
    with pytest.raises(TypeError, match="unknown engine argument 'max_num_seq'; did you mean"):
        LLM("tiny_v41", max_num_seq=2)


def _assert_names_exist(key: str, advice: str) -> None:
    """Every keyword the advice names (snake_case) is one this package takes or has."""
    import dsv4.sharding
    from serving.config import engine_fields
    from serving.outputs import CompletionOutput, RequestOutput

    known = (
        {f.name for f in engine_fields()}
        | {key, "best_of", "prompt_token_ids"}
        | set(dir(dsv4.sharding))
    )
    for cls in (SamplingParams, CompletionOutput, RequestOutput):
        known |= {f.name for f in dataclasses.fields(cls)}
    names = set(re.findall(r"\b[a-z]+(?:_[a-z]+)+\b", advice.replace(".json", "")))
    assert names <= known, (key, names - known)


def test_best_of_and_vllm_sampling_keywords_say_what_to_use_instead():
    """best_of (vLLM V0's): None or n is its meaning here (n samples, all returned); the best of
    k is refused, naming what vLLM V1 advises; each other vLLM-only keyword names its
    replacement; a misspelt one names the closest field."""
    base = SamplingParams(n=2, temperature=1.0)
    assert SamplingParams(n=2, temperature=1.0, best_of=2) == base
    assert SamplingParams(best_of=None) == SamplingParams()
    assert dataclasses.replace(base, n=3).n == 3
    for bad in (3, 1, 2.5, 2.0, True):
        with pytest.raises(ValueError, match=rf"^best_of={bad} is not supported: None or n=2 .*"
                                             r"n=k samples with logprobs=0 .*cumulative_logprob"):  # fmt: skip
            SamplingParams(n=2, temperature=1.0, best_of=bad)
    _assert_names_exist("best_of", BEST_OF_ADVICE)
    for key, advice in VLLM_ONLY_SAMPLING.items():
        with pytest.raises(TypeError, match=rf"^{key}=1 \(a vLLM sampling parameter\) is not "):
            SamplingParams(**{key: 1})
        _assert_names_exist(key, advice)
    with pytest.raises(TypeError, match="unknown sampling parameter 'tempreature'; did you mean "
                                        "'temperature'"):  # fmt: skip
        SamplingParams(tempreature=0.5)


def test_best_of_through_the_server_is_a_400_naming_it():
    from serving.openai_protocol import ChatCompletionRequest, CompletionRequest
    from serving.server import HTTPError, _sampling_params

    body = CompletionRequest(prompt="x", n=2, temperature=1.0, best_of=2)
    assert _sampling_params(body, max_tokens=4, logprobs=None) == SamplingParams(
        n=2, temperature=1.0, max_tokens=4
    )
    for body in (
        CompletionRequest(prompt="x", best_of=3),
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], best_of=3),
    ):
        with pytest.raises(HTTPError) as exc:
            _sampling_params(body, max_tokens=4, logprobs=None)
        assert exc.value.status == 400 and exc.value.param == "best_of"
        assert "cumulative_logprob" in exc.value.message


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["serve", "tiny_v41", "--gpu-memory-utilization", "0.9"], "--gpu-memory-utilization"),
        (["generate", "--prompt", "x", "--enforce-eager"], "--enforce-eager"),
        (["generate", "--prompt", "x", "--best-of=3"], "--best-of"),
    ],
)
def test_a_vllm_flag_on_the_cli_says_what_to_use_instead(usage_error, argv, flag):
    from serving.cli import build_parser

    _, err = usage_error(argv)
    assert f"unrecognized arguments: {flag}" in err and f"; {flag} is vLLM's, not supported" in err
    command = build_parser()._subparsers._group_actions[0].choices[argv[0]]
    named = set(re.findall(r"(--[a-z][a-z-]+)", err.split("not supported here: ")[1]))
    assert named <= set(command._option_string_actions) | {"--help"}, named


def test_a_pool_too_small_for_one_request_is_refused_in_python_and_on_the_cli(capsys, monkeypatch):
    """One check (`Engine.check_config`), before any weights load, by its name in Python and
    by its flag on the CLI."""
    import serving.llm
    from serving.cli import main

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(serving.llm, "_load_model", no_weights)
    with pytest.raises(ConfigError, match=r"num_gpu_blocks_override=3 is not allowed: a pool of "
                                          r"at least (\d+) blocks") as exc:  # fmt: skip
        LLM("tiny_v41", **{**LLM_ARGS, "num_gpu_blocks_override": 3, "warm_up": False})
    need = re.search(r"at least (\d+) blocks", str(exc.value))[1]
    with pytest.raises(SystemExit) as code:
        main(["generate", "--model", "tiny_v41", "--num-gpu-blocks", "3", "--prompt", "x",
              "--max-model-len", str(MAX_MODEL_LEN), "--max-num-batched-tokens",
              str(TOKEN_BUCKET), "--no-compilation-cache", "--no-warm-up"])  # fmt: skip
    err = capsys.readouterr().err
    assert code.value.code == 2 and len(err.splitlines()) == 1, err
    assert f"--num-gpu-blocks 3: gives 3 blocks; at least {need} needed" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--logprobs", "1000"], r"--logprobs 1000: must be in 0\.\.5 \(--max-logprobs 5\)"),
        (["--prompt", "y" * 300], r"--prompt #2 'y{37}\.\.\.': 30\d tokens; at most 127"),
        (["--max-model-len", "4096"], r"--max-model-len 4096: at most the model's max_seq_len"),
    ],
)
def test_the_cli_refuses_before_loading_a_model(usage_error, monkeypatch, argv, message):
    import serving.llm

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(serving.llm, "LLM", no_model)
    argv = ["generate", "--model", "tiny_v41", "--max-logprobs", "5", "--prompt", "x", *argv]
    if "--max-model-len" not in argv:
        argv += ["--max-model-len", "128"]
    _, err = usage_error(argv)
    assert "dsv4 generate: error: " in err and re.search(message, err), err


def test_lab_refuses_a_file_as_out_and_unknown_workload_arguments(usage_error, tmp_path):
    file = tmp_path / "taken"
    file.write_text("")
    _, err = usage_error(["lab", "--out", str(file), "--no-plots"])
    assert "--out" in err and "an existing file; give a directory" in err
    _, err = usage_error(["lab", "--out", str(tmp_path / "o"), "--workload-arg", "bogus=1"])
    assert "workload 'chat' has no argument 'bogus'; its arguments: num_system_prompts," in err
    assert not (tmp_path / "o").exists()


def test_version_and_every_flag_shows_its_default(capsys):
    import argparse

    from serving.cli import build_parser, main

    with pytest.raises(SystemExit) as code:
        main(["--version"])
    assert code.value.code == 0 and capsys.readouterr().out.startswith("dsv4 0.")
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for name, command in sub.choices.items():
        formatter = command._get_formatter()
        for action in command._actions:
            if action.option_strings and action.default is not argparse.SUPPRESS:
                assert "%(default)" in formatter._get_help_string(action), (name, action.dest)
                # argparse prints neither help nor default for an empty help; one default only
                assert action.help and action.help.strip(), (name, action.dest)
                own = action.help.replace("(default: %(default)s)", "")
                assert not re.search(r"\(default|\([\d.]+\)", own) or action.dest == "api_key", (
                    name,
                    action.help,
                )
        assert "(default: " in command.format_help()
    assert "``" not in parser.format_help() and "dsv4 COMMAND --help" in parser.format_help()


# -- the fuzz --------------------------------------------------------------------------------------

_ID = st.one_of(
    st.integers(-3, 520), st.floats(-1, 600), st.just(math.nan), st.booleans(), st.just("7")
)
_GOOD_PROMPT = st.one_of(
    st.lists(st.integers(0, 511), min_size=1, max_size=REF_WIDTH - 4),
    st.text(min_size=1, max_size=12),
)
_BAD_PROMPT = st.one_of(
    st.lists(_ID, min_size=0, max_size=6),
    st.lists(st.integers(0, 511), min_size=MAX_MODEL_LEN, max_size=MAX_MODEL_LEN + 2),
    st.just(""),
    st.none(),
    st.just(np.array([3.0, 4.0])),
)
_GOOD_SAMPLING = st.fixed_dictionaries(
    {"max_tokens": st.integers(1, 3)},
    optional={
        "logprobs": st.one_of(st.none(), st.integers(0, 5)),
        "stop_token_ids": st.lists(st.integers(0, 511), max_size=2),
    },
)
_BAD_SAMPLING = st.fixed_dictionaries(
    {},
    optional={
        "max_tokens": st.one_of(st.integers(-2, 0), st.floats(0, 3), st.none()),
        "logprobs": st.one_of(st.integers(-2, -1), st.integers(6, 9), st.just(2.5)),
        "temperature": st.one_of(st.floats(), st.just(-1.0)),
        "top_p": st.one_of(st.floats(-0.5, 1.5), st.just(math.nan)),
        "stop_token_ids": st.lists(st.integers(-2, 520), min_size=1, max_size=2),
        "n": st.integers(-1, 2),
    },
)


def _clear_refusal(exc: Exception) -> None:
    """A refusal names the value and what is allowed, on one line."""
    text = str(exc)
    assert isinstance(exc, ValueError | TypeError) and text and "\n" not in text, repr(exc)


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(
    good=st.lists(_GOOD_PROMPT, min_size=1, max_size=3),
    bad=st.one_of(st.none(), st.none(), _BAD_PROMPT.map(lambda p: [p])),
    at=st.integers(0, 3),
    sampling=st.one_of(_GOOD_SAMPLING, _GOOD_SAMPLING, _BAD_SAMPLING),
)
def test_fuzz_llm_generate(llm, good, bad, at, sampling):
    """Random batches (maybe one bad prompt among good ones) and sampling parameters: a clear
    refusal, after which nothing ran, or greedy outputs equal to `dsv4.generate`'s with finite
    logprobs; the next good request's output is unchanged either way."""
    prompts = good[:at] + (bad or []) + good[at:]
    try:
        sp = SamplingParams(**{"temperature": 0.0, "ignore_eos": True, **sampling})
    except (ValueError, TypeError) as exc:
        _clear_refusal(exc)
        sp = None
    if sp is not None and sp.max_tokens is not None and sp.max_tokens <= 3:
        steps = llm.engine.stats.num_steps
        try:
            outs = llm.generate(prompts, sp, use_tqdm=False)
        except (ValueError, TypeError) as exc:
            _clear_refusal(exc)
            assert llm.engine.stats.num_steps == steps and not llm.engine.has_unfinished_requests()
        else:
            got = [o.outputs[0].token_ids for o in outs]
            assert got == _reference(llm, [_ids(llm, p) for p in prompts], sp)
            for o in outs:
                for entry in o.outputs[0].logprobs or []:
                    assert all(math.isfinite(lp.logprob) for lp in entry.values())
    assert _tokens(llm, [GOOD_PROMPT]) == _good_tokens(llm)


def _ids(llm, prompt) -> list[int]:
    tok = llm.get_tokenizer()
    if isinstance(prompt, str):
        return tok.encode(prompt, add_bos=tok.bos_id is not None)
    return [int(t) for t in prompt]


_GOOD: list[list[int]] = []


def _good_tokens(llm) -> list[list[int]]:
    if not _GOOD:
        _GOOD.extend(_reference(llm, [GOOD_PROMPT], GREEDY))
    return _GOOD


def test_layout_takes_the_model_names_the_rest_takes(capsys):
    """``dsv4 layout --model`` names what `LLM` and ``dsv4 plan`` name; ``tiny_v41``'s layout
    read from its config is the allocator's test topology, the short names still work."""
    import argparse

    from cache.layout import tiny_v41_desc, v41_flash_desc
    from serving.cli import _desc, main

    def desc(name, k=0):
        return _desc(argparse.Namespace(model=name, num_speculative_tokens=k))

    assert desc("tiny_v41", 2) == desc("tiny", 2) == tiny_v41_desc(num_speculative_tokens=2)
    assert desc("v41_flash") == desc("flash") == v41_flash_desc()
    for name in ("tiny_v41_full", "tiny_v41_trained"):
        assert main(["layout", "--model", name, "--memory-gib", "0.01"]) == 0
        assert "KV-cache pool: " in capsys.readouterr().out

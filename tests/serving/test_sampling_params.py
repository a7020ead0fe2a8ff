"""SamplingParams: vLLM's defaults, normalisation, validation messages and helpers."""

import math

import numpy as np
import pytest

from serving.sampling_params import SamplingParams, SamplingType


def test_defaults_are_vllms():
    p = SamplingParams()
    assert (p.n, p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (1, 0, 0, 1)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1.0, 1.0, 0, 0.0, None)
    assert (p.stop, p.stop_token_ids, p.ignore_eos) == ([], [], False)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.prompt_logprobs) == (16, 0, None, None)
    assert p.detokenize and p.skip_special_tokens and p.spaces_between_special_tokens
    assert not p.include_stop_str_in_output
    assert p.sampling_type == SamplingType.RANDOM and not p.is_greedy and not p.uses_penalties


def test_normalisation():
    p = SamplingParams(stop="###", stop_token_ids=[5, 3, 5], seed=-1, logprobs=True)
    assert p.stop == ["###"] and p.stop_token_ids == [5, 3] and p.seed is None
    assert p.logprobs == 1
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(prompt_logprobs=True).prompt_logprobs == 1
    assert SamplingParams(max_tokens=None).max_tokens is None


def test_greedy_resets_truncation_and_needs_n_1():
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)
    assert p.sampling_type == SamplingType.GREEDY and p.is_greedy
    assert SamplingParams(temperature=9e-6).is_greedy
    assert not SamplingParams(temperature=1e-5).is_greedy
    with pytest.raises(ValueError, match=r"n=2 .*greedy"):
        SamplingParams(temperature=0.0, n=2)


def test_sampling_type_seeded():
    assert SamplingParams(seed=7).sampling_type == SamplingType.RANDOM_SEED
    assert SamplingParams(seed=7, temperature=0).sampling_type == SamplingType.GREEDY


def test_uses_penalties():
    assert SamplingParams(presence_penalty=0.1).uses_penalties
    assert SamplingParams(frequency_penalty=-0.1).uses_penalties
    assert SamplingParams(repetition_penalty=1.1).uses_penalties
    assert not SamplingParams(repetition_penalty=1.0).uses_penalties


def test_stop_token_id_sets():
    p = SamplingParams(stop_token_ids=[7, 2])
    assert p.all_stop_token_ids(2) == [2, 7]
    assert p.all_stop_token_ids(None) == [7, 2]
    q = SamplingParams(stop_token_ids=[7], ignore_eos=True)
    assert q.all_stop_token_ids(2) == [7]  # EOS does not end the output
    assert q.min_tokens_stop_ids(2) == [2, 7]  # ...but min_tokens still masks it (vLLM)
    assert p.min_tokens_stop_ids(None) == [7, 2]


# (kwargs, substrings the message must contain: field=value and the allowed range)
BAD = [
    (dict(n=0), ["n=0", ">= 1"]),
    (dict(n=1.0), ["n=1.0", "int"]),
    (dict(n=True), ["n=True", "int"]),
    (dict(presence_penalty=2.5), ["presence_penalty=2.5", "[-2, 2]"]),
    (dict(presence_penalty=-2.01), ["presence_penalty=-2.01", "[-2, 2]"]),
    (dict(presence_penalty=math.nan), ["presence_penalty=nan", "[-2, 2]"]),
    (dict(frequency_penalty=3), ["frequency_penalty=3", "[-2, 2]"]),
    (dict(frequency_penalty="1"), ["frequency_penalty='1'", "[-2, 2]"]),
    (dict(repetition_penalty=0.0), ["repetition_penalty=0.0", "> 0"]),
    (dict(repetition_penalty=-1.0), ["repetition_penalty=-1.0", "> 0"]),
    (dict(repetition_penalty=math.inf), ["repetition_penalty=inf", "finite"]),
    (dict(temperature=-0.1), ["temperature=-0.1", ">= 0"]),
    (dict(temperature=math.inf), ["temperature=inf", "finite"]),
    (dict(temperature=math.nan), ["temperature=nan", "finite"]),
    (dict(top_p=0.0), ["top_p=0.0", "(0, 1]"]),
    (dict(top_p=1.5), ["top_p=1.5", "(0, 1]"]),
    (dict(top_k=-2), ["top_k=-2", "0 or -1"]),
    (dict(top_k=2.0), ["top_k=2.0", "int"]),
    (dict(top_k=True), ["top_k=True", "int"]),
    (dict(min_p=-0.1), ["min_p=-0.1", "[0, 1]"]),
    (dict(min_p=1.1), ["min_p=1.1", "[0, 1]"]),
    (dict(max_tokens=0), ["max_tokens=0", "None or an int >= 1"]),
    (dict(max_tokens=2.5), ["max_tokens=2.5", "int >= 1"]),
    (dict(min_tokens=-1), ["min_tokens=-1", ">= 0"]),
    (dict(min_tokens=17), ["min_tokens=17", "max_tokens=16"]),
    (dict(min_tokens=1.0), ["min_tokens=1.0", "int"]),
    (dict(logprobs=-1), ["logprobs=-1", "full-vocabulary", "not supported"]),
    (dict(logprobs=-2), ["logprobs=-2", "int >= 0"]),
    (dict(logprobs=1.5), ["logprobs=1.5", "int >= 0"]),
    (dict(logprobs=False), ["logprobs=False", "int >= 0"]),
    (dict(prompt_logprobs=-1), ["prompt_logprobs=-1", "not supported"]),
    (dict(prompt_logprobs=-3), ["prompt_logprobs=-3", "int >= 0"]),
    (dict(stop=["ok", ""]), ["stop=['ok', '']", "non-empty"]),
    (dict(stop=""), ["stop=['']", "non-empty"]),
    (dict(stop=[3]), ["stop=[3]", "strings"]),
    (dict(stop=5), ["stop=5", "string"]),
    (dict(stop="x", detokenize=False), ["stop=['x']", "detokenize=True"]),
    (dict(stop_token_ids=[1, -1]), ["stop_token_ids=[1, -1]", "ints >= 0"]),
    (dict(stop_token_ids=[1, 2.0]), ["stop_token_ids=[1, 2.0]", "ints >= 0"]),
    (dict(stop_token_ids=[True]), ["stop_token_ids=[True]", "ints >= 0"]),
    (dict(stop_token_ids=3), ["stop_token_ids=3", "list of ints"]),
    (dict(seed=1.5), ["seed=1.5", "int"]),
    (dict(seed=True), ["seed=True", "int"]),
    (dict(seed=2**64), [f"seed={2**64}", "[-2**63, 2**64)"]),
    (dict(seed=-(2**63) - 1), [f"seed={-(2**63) - 1}", "[-2**63, 2**64)"]),
    (dict(ignore_eos=1), ["ignore_eos=1", "True or False"]),
    (dict(detokenize=None), ["detokenize=None", "True or False"]),
]


@pytest.mark.parametrize(("kwargs", "parts"), BAD, ids=[str(k) for k, _ in BAD])
def test_invalid_values_name_field_value_and_range(kwargs, parts):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    for part in parts:
        assert part in str(err.value), (part, str(err.value))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(top_k=-1),
        dict(top_k=0),
        dict(top_k=1),
        dict(presence_penalty=-2, frequency_penalty=2),
        dict(top_p=1e-9),
        dict(min_p=1.0),
        dict(min_tokens=16),
        dict(max_tokens=None, min_tokens=1000),
        dict(logprobs=0, prompt_logprobs=20),
        dict(n=np.int64(3), top_k=np.int32(5), temperature=np.float32(0.5)),
        dict(seed=2**64 - 1),
        dict(seed=-(2**63)),
        dict(temperature=5.0),
    ],
)
def test_valid_edges(kwargs):
    SamplingParams(**kwargs)


def test_verify_needs_vocab_and_logprob_limit():
    SamplingParams(stop_token_ids=[0, 99], logprobs=20, prompt_logprobs=20).verify(100, 20)
    with pytest.raises(ValueError, match=r"stop_token_ids=\[3, 100\].*\[100\].*\[0, 100\)"):
        SamplingParams(stop_token_ids=[3, 100]).verify(100, 20)
    with pytest.raises(ValueError, match=r"logprobs=21 .*max_logprobs=20"):
        SamplingParams(logprobs=21).verify(100, 20)
    with pytest.raises(ValueError, match=r"prompt_logprobs=5 .*max_logprobs=4"):
        SamplingParams(prompt_logprobs=5).verify(100, 4)

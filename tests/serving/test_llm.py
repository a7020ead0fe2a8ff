"""`LLM` (vLLM's offline API) and the engine's request-level features: prompt forms, output
shapes, logprobs and prompt logprobs against the reference, stop strings, n > 1, min_tokens,
metrics, KV events, bad input, and a checkpoint loaded by path."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_testing import (
    LLM_ARGS,
    MAX_MODEL_LEN,
    Arrival,
    assert_pool_is_whole,
    drive,
    make_engine,
    reference_tokens,
)

from dsv4 import reference
from dsv4.checkpoint import load_pretrained, save_pretrained
from dsv4.tokenizer import ByteTokenizer
from serving import LLM, SamplingParams
from serving.config import EngineConfig
from serving.engine import Engine
from serving.metrics import compilation_count
from serving.outputs import Logprob


@pytest.fixture(scope="module")
def llm():
    with jax.default_matmul_precision("highest"):
        return LLM("tiny_v41", **LLM_ARGS)


@functools.cache
def _ref_logits(params_id, cfg, tokens: tuple[int, ...]):
    out = reference.forward(_P[params_id], cfg, jnp.asarray([tokens], jnp.int32))
    return np.asarray(jax.nn.log_softmax(out[0], axis=-1))


_P: dict[int, object] = {}


def ref_logprobs(params, cfg, tokens):
    _P[id(params)] = params
    return _ref_logits(id(params), cfg, tuple(tokens))


def test_prompt_forms_and_output_shape(llm):
    tok = llm.get_tokenizer()
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    text = "DeepSeek on a tiny model"
    outs = llm.generate(
        [
            text,
            tok.encode(text, add_bos=True),
            {"prompt_token_ids": tok.encode(text, add_bos=True)},
        ],
        sp,
        use_tqdm=False,
    )
    assert [o.request_id for o in outs] == sorted((o.request_id for o in outs), key=int)
    a, b, c = outs
    assert a.prompt == text and b.prompt is None
    assert a.prompt_token_ids == b.prompt_token_ids == c.prompt_token_ids
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
    comp = a.outputs[0]
    assert comp.index == 0 and len(comp.token_ids) == 5 and comp.finish_reason == "length"
    assert comp.text == tok.decode(comp.token_ids) and comp.logprobs is None
    m = a.metrics
    assert m.ttft is not None and m.ttft >= 0 and m.tpot is not None and m.e2e_latency >= m.ttft
    assert m.num_generation_tokens == 5
    single = llm.generate(text, sp, use_tqdm=False)  # one prompt, not a list
    assert single[0].outputs[0].token_ids == comp.token_ids
    assert_pool_is_whole(llm.engine)


def test_greedy_equals_reference_decoding_and_logprobs(llm, tiny_params, tiny_cfg):
    """Greedy tokens = argmax of reference.forward; logprobs (raw log_softmax), ranks and the
    top-n against the reference; prompt_logprobs of every prompt position."""
    prompt = list(np.random.default_rng(3).integers(3, tiny_cfg.vocab_size, 21))
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3,
                        prompt_logprobs=2)  # fmt: skip
    (out,) = llm.generate([prompt], sp, use_tqdm=False)
    comp = out.outputs[0]
    seq = prompt + comp.token_ids
    ref = ref_logprobs(tiny_params, tiny_cfg, seq)
    total = 0.0
    for i, token in enumerate(comp.token_ids):
        row = ref[len(prompt) - 1 + i]
        assert token == int(np.argmax(row))
        entry = comp.logprobs[i]
        assert isinstance(entry[token], Logprob) and entry[token].rank == 1
        np.testing.assert_allclose(entry[token].logprob, row[token], atol=1e-4)
        top = np.argsort(-row)[:3]
        assert set(entry) == set(top.tolist())
        for rank, t in enumerate(top, 1):
            assert entry[int(t)].rank == rank
            np.testing.assert_allclose(entry[int(t)].logprob, row[t], atol=1e-4)
        total += entry[token].logprob
    np.testing.assert_allclose(comp.cumulative_logprob, total, rtol=1e-6)
    plp = out.prompt_logprobs
    assert len(plp) == len(prompt) and plp[0] is None
    for p in range(1, len(prompt)):
        row = ref[p - 1]
        entry = plp[p]
        np.testing.assert_allclose(entry[prompt[p]].logprob, row[prompt[p]], atol=1e-4)
        assert entry[prompt[p]].rank == int(np.sum(row >= row[prompt[p]]))
        assert len(entry) in (2, 3) and set(np.argsort(-row)[:2].tolist()) <= set(entry)
    assert out.num_cached_tokens == 0  # prompt logprobs never read the prefix cache


@pytest.mark.parametrize("steps", [1, 4])
def test_prompt_logprobs_survive_chunking_and_preemption(tiny_params, tiny_cfg, steps):
    """Prompt logprobs of a long prompt computed over several 4-token chunks, next to
    requests that keep the pool full; with bursts (``steps`` 4) every chunk runs as a burst of
    one (its bucket is a decode step's, compiled as the burst program only)."""
    engine = make_engine(tiny_params, tiny_cfg, max_num_batched_tokens=4, num_scheduler_steps=steps)
    runner = engine.runner  # its one bucket holds a decode step: with bursts, the burst program's
    assert runner.burst_buckets == (set(runner.token_buckets) if steps > 1 else set())
    prompt = tuple(np.random.default_rng(4).integers(3, tiny_cfg.vocab_size, 30).tolist())
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=0)
    finals, _ = drive(engine, [Arrival(0, "p", prompt, sp)])
    ref = ref_logprobs(tiny_params, tiny_cfg, prompt + tuple(finals["p"].outputs[0].token_ids))
    plp = finals["p"].prompt_logprobs
    got = np.array([plp[p][prompt[p]].logprob for p in range(1, len(prompt))])
    want = np.array([ref[p - 1][prompt[p]] for p in range(1, len(prompt))])
    np.testing.assert_allclose(got, want, atol=1e-4)
    assert all(len(plp[p]) == 1 for p in range(1, len(prompt)))
    assert_pool_is_whole(engine)


def test_stop_strings_stop_token_ids_min_tokens_and_n(llm):
    tok = llm.get_tokenizer()
    base = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    (free,) = llm.generate(["stop here"], base, use_tqdm=False)
    tokens = free.outputs[0].token_ids
    # a stop string: the text of tokens 3..4 of the free run
    stop = tok.decode(tokens[3:5])
    if stop:
        (cut,) = llm.generate(["stop here"], SamplingParams(**{**vars(base), "stop": [stop]}),
                              use_tqdm=False)  # fmt: skip
        c = cut.outputs[0]
        assert c.finish_reason == "stop" and c.stop_reason == stop
        assert c.text == free.outputs[0].text[: free.outputs[0].text.find(stop)]
        assert stop not in c.text and c.token_ids == tokens[: len(c.token_ids)]
        (keep,) = llm.generate(
            ["stop here"],
            SamplingParams(**{**vars(base), "stop": [stop], "include_stop_str_in_output": True}),
            use_tqdm=False,
        )
        assert keep.outputs[0].text.endswith(stop)
    # a stop token id: the third token of the free run
    (ids,) = llm.generate(["stop here"], SamplingParams(**{**vars(base), "stop_token_ids": [tokens[2]]}),
                          use_tqdm=False)  # fmt: skip
    first = tokens.index(tokens[2])
    assert ids.outputs[0].token_ids == tokens[: first + 1]
    assert ids.outputs[0].finish_reason == "stop" and ids.outputs[0].stop_reason == tokens[2]
    # min_tokens masks the stop token for the first outputs
    (held,) = llm.generate(
        ["stop here"],
        SamplingParams(**{**vars(base), "stop_token_ids": [tokens[0]], "min_tokens": 3}),
        use_tqdm=False,
    )
    got = held.outputs[0].token_ids
    assert tokens[0] not in got[:3] and (got[-1] == tokens[0] or len(got) == 12)
    # n > 1: children sample independently, seeded children reproducibly
    sp = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    (many,) = llm.generate(["fan out"], sp, use_tqdm=False)
    assert [c.index for c in many.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in many.outputs}) > 1
    (again,) = llm.generate(["fan out"], sp, use_tqdm=False)
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in many.outputs]
    assert_pool_is_whole(llm.engine)


def test_kv_events_and_stats(tiny_params, tiny_cfg):
    engine = make_engine(tiny_params, tiny_cfg, enable_kv_cache_events=True)
    seen = []
    engine.subscribe_kv_events(seen.extend)
    prompt = tuple(range(3, 60))
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    finals, _ = drive(engine, [Arrival(0, "a", prompt, sp), Arrival(8, "b", prompt, sp)])
    stored = [e for e in seen if type(e).__name__ == "BlockStored"]
    assert stored and {e.group_idx for e in stored} >= {0, 1}
    assert finals["b"].num_cached_tokens >= 16
    st = engine.stats
    assert st.num_requests_finished == 2 and st.num_generation_tokens == 6
    assert (
        st.prefix_cache_hits == finals["b"].num_cached_tokens and 0 < st.prefix_cache_hit_rate < 1
    )
    assert st.compilations_after_warm_up == 0 and st.warm_up_compilations >= 0
    assert len(engine.kv_cache_usage_per_group()) == 3


def test_bad_input_is_rejected_and_changes_nothing(llm, tiny_cfg):
    """Each bad request raises a ValueError naming the value and what is allowed, queues
    nothing, and the good requests' outputs are those of a clean run."""
    engine = llm.engine
    good = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    clean = [o.outputs[0].token_ids for o in llm.generate(["one", "two"], good, use_tqdm=False)]
    engine.add_request("keep1", llm.get_tokenizer().encode("one", add_bos=True), good)
    bad_cases = [
        (lambda: llm.generate([[]], good), "empty"),
        (lambda: llm.generate([""], good), "non-empty"),
        (lambda: llm.generate([[5] * MAX_MODEL_LEN], good), r"128 tokens.*1\.\.127"),
        (lambda: llm.generate([[5, tiny_cfg.vocab_size]], good), r"512.*\[0, 512\)"),
        (lambda: llm.generate([[5, -1]], good), "-1"),
        (lambda: SamplingParams(max_tokens=0), "max_tokens=0"),
        (lambda: SamplingParams(temperature=-0.5), "temperature=-0.5"),
        (lambda: SamplingParams(top_p=0.0), "top_p=0.0"),
        (lambda: SamplingParams(top_p=1.5), "top_p=1.5"),
        (lambda: llm.generate(["x"], SamplingParams(logprobs=6)), "6"),
        (lambda: engine.add_request("keep1", [5, 6], good), "duplicate request id 'keep1'"),
        (lambda: engine.abort_request("nobody"), "unknown request ids \\['nobody'\\]"),
        (lambda: llm.generate(["a", "b"], [good]), "one per prompt"),
    ]
    for call, message in bad_cases:
        with pytest.raises(ValueError, match=message):
            call()
    engine.add_request("keep2", llm.get_tokenizer().encode("two", add_bos=True), good)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0].token_ids
    assert finals == {"keep1": clean[0], "keep2": clean[1]}
    assert_pool_is_whole(engine)


def test_llm_arguments_are_checked():
    for kwargs, message in [
        (dict(dtype="float16"), "dtype='float16'"),
        (dict(kv_cache_dtype="fp4"), "kv_cache_dtype='fp4'"),
        (dict(max_num_seqs=0), "max_num_seqs=0"),
        (dict(max_model_len=10_000), "max_model_len=10000"),
        (dict(model="no/such/dir"), "model='no/such/dir'"),
        (dict(pool_layout="dense"), "pool_layout='dense'"),
        (dict(num_scheduler_steps=0), "num_scheduler_steps=0"),
        (dict(num_scheduler_steps=2.0), "num_scheduler_steps=2.0"),
        (dict(gc_threshold=0), "gc_threshold=0"),
        (dict(num_scheduler_steps=4, async_scheduling=False), "num_scheduler_steps=4 .*async"),
        (
            dict(
                num_scheduler_steps=4,
                speculative_config={"method": "ngram", "num_speculative_tokens": 2},
            ),
            "num_scheduler_steps=4 .*speculative",
        ),
    ]:
        with pytest.raises(ValueError, match=message):
            LLM(**{"model": "tiny_v41", "warm_up": False, **LLM_ARGS, **kwargs})


def test_the_loop_collects_garbage_less_often_and_puts_the_threshold_back(llm, monkeypatch):
    """While LLM's loop runs, Python's young collections start after ``gc_threshold`` new
    objects (a burst of steps crossed CPython's 700 again and again); afterwards, and after an
    error in the loop, the caller's thresholds are back; None leaves them alone."""
    import dataclasses
    import gc

    engine = llm.llm_engine
    seen = []
    step = engine.step

    def spy():
        seen.append(gc.get_threshold())
        return step()

    monkeypatch.setattr(engine, "step", spy)
    before = gc.get_threshold()
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    llm.generate([[5, 6, 7]], sp, use_tqdm=False)
    limit = engine.config.compilation_config.gc_threshold
    assert limit == 50_000 and seen and {t[0] for t in seen} == {limit}
    assert gc.get_threshold() == before

    def boom():
        raise RuntimeError("step failed")

    monkeypatch.setattr(engine, "step", boom)
    with pytest.raises(RuntimeError, match="step failed"):
        llm.generate([[5, 6, 7]], sp, use_tqdm=False)
    assert gc.get_threshold() == before
    monkeypatch.setattr(engine, "step", step)
    engine.step()  # the aborted request's final output

    compilation = dataclasses.replace(engine.config.compilation_config, gc_threshold=None)
    config = dataclasses.replace(engine.config, compilation_config=compilation)
    monkeypatch.setattr(engine, "config", config)
    with engine.serving_loop():
        assert gc.get_threshold() == before


@pytest.mark.parametrize("error", [RuntimeError("step failed"), KeyboardInterrupt()])
def test_an_interrupted_generate_leaves_nothing_behind(llm, monkeypatch, error):
    """A step that raises (or Ctrl-C in a notebook) part-way through `LLM.generate`: the error
    reaches the caller, the call's requests are aborted (none runs on in the next call, every
    block and slot comes back), and the next call's tokens are greedy `dsv4.generate`'s."""
    engine = llm.llm_engine
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    arrivals = [Arrival(0, str(i), tuple(p), sp) for i, p in enumerate(prompts)]
    want = reference_tokens(engine.runner.params, llm.cfg, arrivals)
    step, calls = engine.step, []

    def failing():
        calls.append(1)
        if len(calls) == 3:  # the requests are running, steps in flight
            raise error
        return step()

    monkeypatch.setattr(engine, "step", failing)
    with pytest.raises(type(error)):
        llm.generate(prompts, sp, use_tqdm=False)
    monkeypatch.setattr(engine, "step", step)
    assert engine.get_num_unfinished_requests() == 0
    while engine.has_unfinished_requests():  # the steps still in flight are applied
        engine.step()
    engine.step()  # the aborted requests' final outputs, nobody's now
    assert_pool_is_whole(engine)
    again = llm.generate(prompts, sp, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in again] == [want[a.request_id] for a in arrivals]
    assert_pool_is_whole(engine)


def test_checkpoint_by_path_equals_the_same_params_in_memory(llm, tmp_path):
    """save_pretrained of the tiny params (fp8 / fp4 where the release quantises), then
    LLM(model=path) against an engine over load_pretrained's params built in memory: same
    config, the byte tokenizer (no tokenizer.json), same tokens and logprobs."""
    save_pretrained(llm.engine.runner.params, llm.cfg, tmp_path)
    with jax.default_matmul_precision("highest"):
        from_disk = LLM(str(tmp_path), **LLM_ARGS)
        cfg, params = load_pretrained(tmp_path, jnp.float32, progress=False)
        in_memory = Engine.build(
            params, cfg, EngineConfig.from_kwargs(**LLM_ARGS), tokenizer=ByteTokenizer()
        )
    assert from_disk.cfg == llm.cfg == cfg
    assert isinstance(from_disk.get_tokenizer(), ByteTokenizer)
    sp = SamplingParams(temperature=0.8, seed=3, max_tokens=8, ignore_eos=True, logprobs=2)
    prompts = [ByteTokenizer().encode("from disk", add_bos=True), [7, 8, 9, 10, 11] * 5]
    disk = from_disk.generate(prompts, sp, use_tqdm=False)
    arrivals = [Arrival(0, f"m{i}", tuple(p), sp) for i, p in enumerate(prompts)]
    with jax.default_matmul_precision("highest"):
        memory, _ = drive(in_memory, arrivals)
    for i, out in enumerate(disk):
        assert out.outputs[0].token_ids == memory[f"m{i}"].outputs[0].token_ids
        assert repr(out.outputs[0].logprobs) == repr(memory[f"m{i}"].outputs[0].logprobs)


def test_chat_needs_a_template(llm):
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat([{"role": "user", "content": "hi"}])
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    (out,) = llm.chat([{"role": "user", "content": "hi"}], sp, chat_template=template,
                      use_tqdm=False)  # fmt: skip
    assert out.prompt == "<user>hi<assistant>"
    (plain,) = llm.generate(["<user>hi<assistant>"], sp, use_tqdm=False)
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids


def test_no_compilation_over_a_long_random_workload(llm, tiny_cfg):
    """Everything the engine can be asked (sampling kinds, penalties, min_tokens, logprobs,
    prompt logprobs, n, stops, aborts) after warm-up: zero compilations."""
    rng = np.random.default_rng(11)
    engine = llm.engine
    before = compilation_count()
    for i in range(30):
        prompt = rng.integers(3, tiny_cfg.vocab_size, int(rng.integers(1, 70))).tolist()
        temperature = float(rng.choice([0.0, 1.0]))
        sp = SamplingParams(
            n=int(rng.integers(1, 3)) if temperature else 1,
            temperature=temperature,
            top_k=int(rng.choice([0, 5])),
            top_p=float(rng.choice([1.0, 0.9])),
            frequency_penalty=float(rng.choice([0.0, 0.3])),
            repetition_penalty=float(rng.choice([1.0, 1.1])),
            min_tokens=int(rng.integers(0, 3)),
            max_tokens=int(rng.integers(3, 20)),
            logprobs=int(rng.choice([0, 5])) if i % 2 else None,
            prompt_logprobs=1 if i % 7 == 0 else None,
            stop_token_ids=rng.integers(3, tiny_cfg.vocab_size, 3).tolist(),
        )
        engine.add_request(f"w{i}", prompt, sp)
        if i % 5 == 4:
            engine.abort_request(f"w{i - 1}")
        for _ in range(int(rng.integers(0, 4))):
            engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    assert compilation_count() == before
    assert_pool_is_whole(engine)

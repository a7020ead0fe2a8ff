"""`LLM`: vLLM's offline API over our engine.

```python
from serving import LLM, SamplingParams

llm = LLM(model="tiny_v41", dtype="float32")  # or LLM(model="/path/to/checkpoint")
outs = llm.generate(["The quick brown fox", [5, 6, 7]], SamplingParams(max_tokens=16))
print(outs[0].outputs[0].text, outs[0].metrics.ttft)
```

Construction builds the model (the seeded ``tiny_v41`` preset, or a released-format checkpoint
directory with its tokenizer), the allocator's `KVCacheConfig` (sized by
``num_gpu_blocks_override`` or ``kv_cache_memory_bytes``), the page pools, the scheduler and the
engine, then compiles every step bucket (warm-up, with a progress bar). JAX's persistent
compilation cache is on by default (``compilation_cache_dir``), so a second start of the same
configuration loads its executables instead of compiling them.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dsv4.checkpoint import SHIPPED, shipped_checkpoint
from dsv4.config import ModelConfig, tiny_v41, tiny_v41_full
from dsv4.paged import records as R
from dsv4.qweights import WEIGHTS_ON_DEVICE
from serving.data_parallel import check_data_parallel_size
from serving.engine import Engine
from serving.outputs import RequestOutput
from serving.runner import check_mesh
from serving.sampling_params import RequestOutputKind, SamplingParams
from serving.spec_decode import SpeculativeConfig

__all__ = ["KV_CACHE_DTYPES", "LLM", "default_compilation_cache_dir"]

KV_CACHE_DTYPES = ("auto", "exact", "bf16", "released", "released_fp8", "sm90")
_FORMATS = {
    "exact": R.EXACT,
    "bf16": R.BF16,
    "released": R.RELEASED,
    "released_fp8": R.RELEASED_FP8,
    "sm90": R.SM90,
}
_PRESETS = {"tiny_v41": tiny_v41, "tiny_v41_full": tiny_v41_full}
_DTYPES = ("bfloat16", "float32")


def default_compilation_cache_dir() -> str:
    """``$XDG_CACHE_HOME/dsv4-jax/jax`` (``~/.cache/dsv4-jax/jax``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "dsv4-jax", "jax")


def enable_compilation_cache(path: str | None) -> None:
    """Point JAX's persistent compilation cache at ``path`` (every executable is kept, however
    fast it compiled), unless the process already chose a directory."""
    if path is None or jax.config.jax_compilation_cache_dir:
        return
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _fail(name: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"{name}={value!r} is not allowed: {allowed}")


def _positive(name: str, value: Any, *, none_ok: bool = False) -> None:
    if value is None and none_ok:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _fail(name, value, "an int >= 1" + (" or None" if none_ok else ""))


class LLM:
    """vLLM's `LLM` for DeepSeek-V4.1 in JAX.

    Args:
        model: a preset name (``"tiny_v41"``: the seeded random tiny model with the built-in
            byte tokenizer; ``"tiny_v41_full"``: the same with Engram and the DSpark drafter),
            a shipped checkpoint (``"tiny_v41_trained"``: the small V4.1 trained on the
            Python standard library, `dsv4.checkpoint.shipped_checkpoint`) or a
            released-format checkpoint directory (`dsv4.load_pretrained`; its tokenizer.json
            when there is one, else the byte tokenizer).
        dtype: params and activations, "bfloat16" or "float32".
        kv_cache_dtype: the cache records (`dsv4.paged.records` presets): "exact" (f32),
            "bf16", "released", "released_fp8", "sm90"; "auto" = exact for float32, bf16
            otherwise.
        max_model_len: longest sequence (prompt + outputs); default the model's max_seq_len.
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: token budget of a step (chunked prefill).
        num_gpu_blocks_override: KV blocks in the pool (wins over the memory budget).
        kv_cache_memory_bytes: KV pool budget; default: 90% of the device's free memory, or
            256 MiB on a device that reports none (the CPU).
        enable_prefix_caching: reuse cached prefixes across requests.
        swa_bounded_replay: V4.1's approximate window replay on prefix hits (vLLM option).
        async_scheduling: plan step N+1 while step N runs (default: on). With speculative
            decoding step N+1 is planned as if step N accepted every draft, and the device
            moves it back by those it rejected; DSpark drafts on the device, n-gram proposes
            on the host one token ahead (`serving.spec_decode.next_drafts_ahead`).
        speculative_config: vLLM's dict, e.g. ``{"method": "ngram", "num_speculative_tokens":
            3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}``, or ``{"method": "dspark",
            "num_speculative_tokens": k}`` for the model's DSpark drafter (k in
            1..``dspark_block_size``; ``tiny_v41_trained`` and ``tiny_v41_full`` have one)
            (`serving.spec_decode`); outputs equal those without it, token for token.
        seed: random tiny weights and the sampling seed of requests that give none.
        block_size / swa_block_size: tokens per compressed / window block (default: 16 / 4
            for a model whose window is under 128 tokens, the tiny family; 64 / 32 otherwise).
        pool_layout: "aliased" (one byte pool, as vLLM) or "separate".
        token_buckets: step sizes to compile (default powers of two from 8 to the budget).
        table_buckets: block-table widths to compile ("auto": full width up to 64 blocks, else
            powers of two from 16 blocks; None: always full width).
        max_logprobs: most logprobs a request may ask for (vLLM's ``max_logprobs``).
        enable_kv_cache_events: record KV events for `Engine.subscribe_kv_events`.
        compilation_cache_dir: JAX's persistent compilation cache (None: off).
        quant_sim: run the official reference's quantisation simulation (`ModelConfig`).
        weights_on_device: "dequantised" (float params, the default) or "released": fp8 / FP4
            weights stay in the checkpoint's bytes on device and are dequantised where the step
            reads them (`dsv4.qweights`), same outputs; a preset's random weights are stored
            as a saved checkpoint would hold them (`dsv4.qweights.quantise_params`).
        warm_up: compile every bucket now (else on first use).
        impl: attention kernels (None: by backend).
        debug: check every step's block ids and slots on the host.
        mesh: run on a device mesh (`dsv4.sharding.make_mesh(data=, expert=, model=)`): params
            split by `dsv4.sharding`'s rule table, heads over ``model``, routed experts over
            ``expert`` with a token dispatch (`dsv4.expert_parallel`), and requests with their
            pages split over ``data`` (below); the same tokens as one device.
        data_parallel_size: D data shards (vLLM's data-parallel attention,
            `serving.data_parallel`): each holds its own requests, scheduler and KV pages
            (``max_num_seqs``, ``max_num_batched_tokens`` and the block counts are per shard,
            as per vLLM rank), new requests go to the least loaded shard, and the D shards
            step in lockstep in one program. None: the mesh's ``data`` axis (1 without a
            mesh); else a multiple of it (several shards per data group of devices, or D
            shards on one device without a mesh).
        num_scheduler_steps: k > 1 runs up to k decode steps as one program (vLLM v0's
            multi-step scheduling): when every running request decodes and none waits, the
            engine plans k steps in a row (each planned ahead of the one before, as
            asynchronous scheduling plans one step ahead) and the device runs them back to
            back, each feeding its tokens to the next; the host learns them afterwards, in
            order. Outputs are those of k = 1 token for token; a request that stops inside a
            burst costs the rest of the burst's steps, and a request that arrives waits for
            the burst to end. Needs async_scheduling, and no speculative decoding, Engram
            model or data parallelism. Default 1.

    Raises:
        ValueError: any argument out of range, naming it and what is allowed.
    """

    def __init__(
        self,
        model: str = "tiny_v41",
        *,
        dtype: str = "bfloat16",
        kv_cache_dtype: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 256,
        num_gpu_blocks_override: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        enable_prefix_caching: bool = True,
        swa_bounded_replay: bool = False,
        async_scheduling: bool | None = None,
        seed: int = 0,
        block_size: int | None = None,
        swa_block_size: int | None = None,
        pool_layout: str = "aliased",
        token_buckets: Sequence[int] | None = None,
        table_buckets: Sequence[int] | str | None = "auto",
        max_logprobs: int = 20,
        enable_kv_cache_events: bool = False,
        compilation_cache_dir: str | None = "default",
        quant_sim: bool = False,
        weights_on_device: str = "dequantised",
        warm_up: bool = True,
        impl: str | None = None,
        debug: bool = False,
        speculative_config: dict | None = None,
        mesh: Any = None,
        data_parallel_size: int | None = None,
        num_scheduler_steps: int = 1,
    ) -> None:
        if speculative_config is not None:  # checked before any weights are loaded
            speculative_config = SpeculativeConfig.from_dict(speculative_config)
        if async_scheduling is None:
            async_scheduling = True
        _check_args(locals())
        check_mesh(mesh)
        check_data_parallel_size(data_parallel_size, mesh)
        if compilation_cache_dir == "default":
            compilation_cache_dir = default_compilation_cache_dir()
        enable_compilation_cache(compilation_cache_dir)
        self.cfg, params, self.tokenizer = _load_model(
            model, dtype, seed, quant_sim, weights_on_device
        )
        self._template = (
            None if model in _PRESETS or model in SHIPPED else _read_chat_template(model)
        )
        max_model_len = max_model_len or self.cfg.max_seq_len
        if max_model_len > self.cfg.max_seq_len:
            raise _fail(
                "max_model_len",
                max_model_len,
                f"at most the model's max_seq_len {self.cfg.max_seq_len}",
            )
        if kv_cache_dtype == "auto":
            kv_cache_dtype = "exact" if dtype == "float32" else "bf16"
        tiny = self.cfg.window_size < 128  # the tiny family (the released window is 128)
        self.llm_engine = Engine.build(
            params,
            self.cfg,
            tokenizer=self.tokenizer,
            formats=_FORMATS[kv_cache_dtype],
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            num_gpu_blocks_override=num_gpu_blocks_override,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            enable_prefix_caching=enable_prefix_caching,
            swa_bounded_replay=swa_bounded_replay,
            async_scheduling=async_scheduling,
            seed=seed,
            block_size=block_size or (16 if tiny else 64),
            swa_block_size=swa_block_size or (4 if tiny else 32),
            pool_layout=pool_layout,
            token_buckets=token_buckets,
            table_buckets=table_buckets,
            max_logprobs=max_logprobs,
            enable_kv_cache_events=enable_kv_cache_events,
            impl=impl,
            debug=debug,
            speculative_config=speculative_config,
            mesh=mesh,
            data_parallel_size=data_parallel_size,
            num_scheduler_steps=num_scheduler_steps,
        )
        self.kv_cache_dtype = kv_cache_dtype
        self.max_model_len = max_model_len
        self._counter = itertools.count()
        if warm_up:
            self.llm_engine.warm_up()

    @property
    def engine(self) -> Engine:
        return self.llm_engine

    def get_tokenizer(self):
        return self.tokenizer

    # ---------------------------------------------------------------- generate

    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt; returns one finished `RequestOutput` per prompt, in order.

        A prompt is a string (tokenized with the model's tokenizer, BOS prepended when it has
        one), a list of token ids, or ``{"prompt_token_ids": [...]}`` (or ``{"prompt": str}``);
        ``prompts`` is one prompt or a list. ``sampling_params`` is one for all or one per
        prompt (default `SamplingParams()`).

        Raises:
            ValueError: a bad prompt or parameter (naming it); nothing is queued then.
        """
        items = _as_list(prompts)
        params = self._params_for(items, sampling_params)
        encoded = [self._encode(p) for p in items]
        priorities = list(priority) if priority is not None else [0] * len(items)
        if len(priorities) != len(items):
            raise _fail("priority", priority, f"one per prompt ({len(items)})")
        engine = self.llm_engine
        # LLM.generate waits for whole outputs: nothing to report before a request finishes
        params = [
            dataclasses.replace(sp, output_kind=RequestOutputKind.FINAL_ONLY) for sp in params
        ]
        ids = [str(next(self._counter)) for _ in items]
        for request_id, (_, token_ids), sp in zip(ids, encoded, params, strict=True):
            engine._check_request(request_id, token_ids, sp)  # all checked before any is queued
        for request_id, (text, token_ids), sp, prio in zip(
            ids, encoded, params, priorities, strict=True
        ):
            engine.add_request(request_id, token_ids, sp, prompt=text, priority=prio)
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: Sequence[Mapping[str, str]] | Sequence[Sequence[Mapping[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to conversations (lists of ``{"role", "content"}`` messages): each
        is rendered with ``chat_template`` or the checkpoint's (``tokenizer_config.json``'s
        ``chat_template``, a Jinja template; rendering needs the ``jinja2`` package).

        Raises:
            ValueError: no template (the checkpoint has none and none was given), or bad
                messages.
        """
        conversations = messages
        if conversations and isinstance(conversations[0], Mapping):
            conversations = [conversations]
        template = chat_template or self._chat_template
        if template is None:
            raise ValueError(
                f"{self._model_name}: the tokenizer has no chat template; pass chat_template= "
                "(a Jinja template) or call generate() with the prompt text"
            )
        prompts = [
            _render_chat(template, conv, add_generation_prompt, self.tokenizer)
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    # ---------------------------------------------------------------- internals

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        engine = self.llm_engine
        done: dict[str, RequestOutput] = {}
        wanted = set(ids)
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm)
        t0 = time.perf_counter()
        try:
            while engine.has_unfinished_requests() and not wanted <= done.keys():
                for out in engine.step():
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
                        bar.update(1)
                        tokens = engine.stats.num_generation_tokens
                        bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - t0):.1f}")
        finally:
            bar.close()
        missing = wanted - done.keys()
        if missing:  # pragma: no cover - the engine ran dry with requests unanswered
            raise RuntimeError(f"requests {sorted(missing)} did not finish")
        return [done[i] for i in ids]

    def _params_for(self, items, sampling_params) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * len(items)
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * len(items)
        params = list(sampling_params)
        if len(params) != len(items):
            raise _fail(
                "sampling_params", f"{len(params)} items", f"one, or one per prompt ({len(items)})"
            )
        for sp in params:
            if not isinstance(sp, SamplingParams):
                raise _fail("sampling_params", sp, "SamplingParams objects")
        return params

    def _encode(self, prompt: Any) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise _fail("prompt", prompt, "a non-empty string, token ids or a dict")
            tok = self.tokenizer
            return prompt, tok.encode(prompt, add_bos=tok.bos_id is not None)
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), _token_list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self._encode(prompt["prompt"])
            raise _fail("prompt", prompt, 'a dict with "prompt_token_ids" or "prompt"')
        return None, _token_list(prompt)

    @property
    def _model_name(self) -> str:
        return getattr(self.tokenizer, "name", "model")

    @property
    def _chat_template(self) -> str | None:
        return self._template


def _token_list(ids: Any) -> list[int]:
    """A prompt of token ids (a list, tuple or 1-D integer array) as Python ints."""
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise _fail("prompt", f"array {ids.dtype}{list(ids.shape)}", "a 1-D integer array")
        return ids.tolist()
    if isinstance(ids, str | bytes) or not isinstance(ids, Sequence):
        raise _fail("prompt", ids, "a string, a list of token ids or a dict")
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int | np.integer)]
    if bad:
        raise _fail("prompt token ids", bad[:8], "ints")
    return [int(t) for t in ids]


def _is_token(t: Any) -> bool:
    return isinstance(t, int | np.integer) and not isinstance(t, bool)


def _as_list(prompts: Any) -> list[Any]:
    """One prompt or a list of prompts -> a list of prompts."""
    if isinstance(prompts, str | Mapping):
        return [prompts]
    if isinstance(prompts, np.ndarray):
        return [prompts] if prompts.ndim == 1 else list(prompts)
    if isinstance(prompts, Sequence) and prompts and all(_is_token(t) for t in prompts):
        return [list(prompts)]  # one prompt of token ids
    if isinstance(prompts, Sequence):
        if not prompts:
            raise _fail("prompts", prompts, "at least one prompt")
        return list(prompts)
    raise _fail("prompts", prompts, "a prompt or a list of prompts")


def _check_args(args: Mapping[str, Any]) -> None:
    if args["dtype"] not in _DTYPES:
        raise _fail("dtype", args["dtype"], f"one of {_DTYPES}")
    if args["kv_cache_dtype"] not in KV_CACHE_DTYPES:
        raise _fail("kv_cache_dtype", args["kv_cache_dtype"], f"one of {KV_CACHE_DTYPES}")
    for name in ("max_num_seqs", "max_num_batched_tokens", "max_logprobs"):
        _positive(name, args[name])
    for name in ("max_model_len", "num_gpu_blocks_override", "kv_cache_memory_bytes"):
        _positive(name, args[name], none_ok=True)
    for name in ("block_size", "swa_block_size"):
        _positive(name, args[name], none_ok=True)
    if args["weights_on_device"] not in WEIGHTS_ON_DEVICE:
        allowed = " or ".join(repr(v) for v in WEIGHTS_ON_DEVICE)
        raise _fail("weights_on_device", args["weights_on_device"], allowed)
    if args["pool_layout"] not in ("aliased", "separate"):
        raise _fail("pool_layout", args["pool_layout"], "'aliased' or 'separate'")
    if isinstance(args["seed"], bool) or not isinstance(args["seed"], int):
        raise _fail("seed", args["seed"], "an int")
    steps = args["num_scheduler_steps"]
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise _fail("num_scheduler_steps", steps, "an int >= 1")
    if steps > 1 and not args["async_scheduling"]:
        raise _fail("num_scheduler_steps", steps, "1 with async_scheduling=False")
    if steps > 1 and args["speculative_config"] is not None:
        raise _fail("num_scheduler_steps", steps, "1 with a speculative_config")
    model = args["model"]
    if not isinstance(model, str) or not (
        model in _PRESETS or model in SHIPPED or os.path.isdir(model)
    ):
        names = ", ".join((*_PRESETS, *SHIPPED))
        raise _fail("model", model, f"a preset ({names}) or a checkpoint directory")


def _load_model(model: str, dtype: str, seed: int, quant_sim: bool, weights_on_device: str):
    from dsv4.tokenizer import load_tokenizer

    jdtype = jnp.dtype(dtype)
    if model in _PRESETS:
        from dsv4.params import init_params
        from dsv4.qweights import quantise_params

        cfg = _PRESETS[model](quant_sim=quant_sim)
        params = init_params(cfg, jax.random.PRNGKey(seed), jdtype)
        if weights_on_device == "released":
            params = quantise_params(params, cfg)
        return cfg, params, load_tokenizer(None, cfg)
    from dsv4.checkpoint import load_pretrained

    if model in SHIPPED:
        model = shipped_checkpoint(model)
    cfg = ModelConfig.from_json(model)
    if quant_sim:
        cfg = dataclasses.replace(cfg, quant_sim=True)
    tokenizer = load_tokenizer(model, cfg)  # before the weights: its errors are cheap
    cfg, params = load_pretrained(
        model, jdtype, config=cfg, progress=True, weights_on_device=weights_on_device
    )
    return cfg, params, tokenizer


def _render_chat(template: str, messages, add_generation_prompt: bool, tokenizer) -> str:
    try:
        import jinja2.sandbox
    except ImportError as exc:  # pragma: no cover - jinja2 is in the test extra
        raise ImportError("chat templates need the jinja2 package: pip install jinja2") from exc
    for m in messages:
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise _fail("messages", m, 'dicts with "role" and "content"')
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    # BOS is prepended when the text is tokenized (as for every string prompt), not by the
    # template; EOS closes earlier assistant turns as the tokenizer spells it
    eos = tokenizer.decode([tokenizer.eos_id]) if tokenizer.eos_id is not None else ""
    return env.from_string(template).render(
        messages=list(messages),
        add_generation_prompt=add_generation_prompt,
        bos_token="",
        eos_token=eos,
    )


def _read_chat_template(path: str) -> str | None:
    file = os.path.join(path, "tokenizer_config.json")
    if not os.path.isfile(file):
        return None
    with open(file, encoding="utf-8") as f:
        template = json.load(f).get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    return template if isinstance(template, str) else None

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
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dsv4.checkpoint import SHIPPED, load_pretrained, shipped_checkpoint
from dsv4.config import MODEL_PRESETS, model_source
from dsv4.config import ModelConfig as ArchConfig
from dsv4.params import init_params
from dsv4.qweights import quantise_params
from dsv4.tokenizer import load_tokenizer
from serving.config import KV_CACHE_DTYPES, EngineConfig, ModelConfig
from serving.engine import Engine
from serving.outputs import RequestOutput
from serving.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["KV_CACHE_DTYPES", "LLM", "default_compilation_cache_dir"]


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


class LLM:
    """vLLM's `LLM` for DeepSeek-V4.1 in JAX (docs/serving.md). Outputs with speculative
    decoding, asynchronous scheduling, bursts or data shards equal those without, token for
    token. An unknown option raises TypeError (naming the closest), a bad value ValueError.

    Args:
        model: a random preset, the shipped ``tiny_v41_trained`` (default) or a checkpoint dir.
        **kwargs: the fields of `serving.config.EngineConfig`'s sections by name (vLLM's names).
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        if model is not None:
            kwargs["model"] = model
        config = EngineConfig.from_kwargs(**kwargs)  # checked before any weights are loaded
        compilation = config.compilation_config
        cache_dir = compilation.compilation_cache_dir
        if cache_dir == "default":
            cache_dir = default_compilation_cache_dir()
        enable_compilation_cache(cache_dir)
        model_config = config.model_config
        arch = _architecture(model_config)
        config = config.offline(arch)  # bursts by default: outputs come whole
        Engine.check_config(arch, config)  # a pool too small for one request: before weights
        self.cfg, params, self.tokenizer = _load_model(model_config, arch)
        _, folder = model_source(model_config.model)  # a shipped checkpoint has one too
        self._template = None if folder is None else _read_chat_template(folder)
        # without a tokenizer the EOS is the model config's (vLLM: the generation config's)
        self.llm_engine = Engine.build(
            params, self.cfg, config, tokenizer=self.tokenizer, eos_token_id=self.cfg.eos_token_id
        )
        self.config = self.llm_engine.config  # its automatic values filled in
        self.kv_cache_dtype = self.config.cache_config.kv_cache_dtype
        self.max_model_len = self.config.model_config.max_model_len
        self._counter = itertools.count()
        if compilation.warm_up:
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
        priorities = list(priority) if priority is not None else [0] * len(items)
        if len(priorities) != len(items):
            raise _fail("priority", priority, f"one per prompt ({len(items)})")
        engine = self.llm_engine
        # LLM.generate waits for whole outputs: nothing to report before a request finishes
        params = [
            dataclasses.replace(sp, output_kind=RequestOutputKind.FINAL_ONLY) for sp in params
        ]
        ids = [str(next(self._counter)) for _ in items]
        texts, prompt_ids = [], []
        for i, (request_id, prompt, sp) in enumerate(zip(ids, items, params, strict=True)):
            # every prompt checked before any is queued; errors name the list index
            text, token_ids = self._encode(prompt, f"prompts[{i}]")
            texts.append(text)
            prompt_ids.append(
                engine.check_request(request_id, token_ids, sp, where=f"prompts[{i}]")
            )
        for request_id, text, token_ids, sp, prio in zip(
            ids, texts, prompt_ids, params, priorities, strict=True
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
        if isinstance(messages, str | Mapping) or not isinstance(messages, Sequence):
            raise TypeError(
                f"messages={messages!r} is not allowed: a list of {{'role', 'content'}} dicts, "
                "or a list of such lists"
            )
        single = bool(messages) and isinstance(messages[0], Mapping)
        conversations = [messages] if single else messages
        names = ["messages"] if single else [f"messages[{i}]" for i in range(len(conversations))]
        prompts = [
            self.render_chat(conv, chat_template=chat_template,
                             add_generation_prompt=add_generation_prompt, where=where)
            for conv, where in zip(conversations, names, strict=True)
        ]  # fmt: skip
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    @property
    def chat_template(self) -> str | None:
        """The checkpoint's chat template (``tokenizer_config.json``); None for a preset."""
        return self._template

    def render_chat(
        self,
        messages: Sequence[Mapping[str, str]],
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        where: str = "messages",
    ) -> str:
        """One conversation as the prompt text `chat` generates from (``where`` names it in
        errors).

        Raises:
            ValueError: no template (the checkpoint has none and none was given), bad messages.
        """
        if self.tokenizer is None:
            raise ValueError(
                f"{where}: chat needs a tokenizer and skip_tokenizer_init=True loads none; "
                "call generate() with token ids"
            )
        template = chat_template or self._template
        if template is None:
            raise ValueError(
                f"{self._model_name}: the tokenizer has no chat template; pass chat_template= "
                "(a Jinja template) or call generate() with the prompt text"
            )
        return _render_chat(template, messages, add_generation_prompt, self.tokenizer, where)

    # ---------------------------------------------------------------- internals

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm import tqdm

        engine = self.llm_engine
        done: dict[str, RequestOutput] = {}
        wanted = set(ids)
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm)
        t0 = time.perf_counter()
        try:
            with engine.serving_loop():
                while engine.has_unfinished_requests() and not wanted <= done.keys():
                    for out in engine.step():
                        if out.finished and out.request_id in wanted:
                            done[out.request_id] = out
                            bar.update(1)
                            tokens = engine.stats.num_generation_tokens
                            bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - t0):.1f}")
        except BaseException:  # a step raised, or KeyboardInterrupt: this call's requests go
            self._abandon([i for i in ids if i not in done])
            raise
        finally:
            bar.close()
        missing = wanted - done.keys()
        if missing:  # pragma: no cover - the engine ran dry with requests unanswered
            raise RuntimeError(f"requests {sorted(missing)} did not finish")
        return [done[i] for i in ids]

    def _abandon(self, ids: list[str]) -> None:
        """Abort ``ids``, the unfinished requests of a `generate` call that did not finish
        (a step raised, or the user interrupted it): they would otherwise run during the next
        call, holding its KV blocks and steps. The call's own error goes on; a failure to abort
        is a warning, not raised over it."""
        try:
            self.llm_engine.abort_request(ids)
        except Exception as exc:  # the step's error is what the caller must see
            warnings.warn(f"could not abort requests {ids} of a failed generate call: {exc!r}",
                          stacklevel=3)  # fmt: skip

    def _params_for(self, items, sampling_params) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * len(items)
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * len(items)
        if isinstance(sampling_params, str | bytes | Mapping) or not isinstance(
            sampling_params, Sequence
        ):
            raise TypeError(
                f"sampling_params={sampling_params!r} is not allowed: a SamplingParams, or a "
                "list of one per prompt"
            )
        params = list(sampling_params)
        if len(params) != len(items):
            raise _fail(
                "sampling_params", f"{len(params)} items", f"one, or one per prompt ({len(items)})"
            )
        for i, sp in enumerate(params):
            if not isinstance(sp, SamplingParams):
                raise TypeError(f"sampling_params[{i}]={sp!r} is not allowed: a SamplingParams")
        return params

    def _encode(self, prompt: Any, where: str) -> tuple[str | None, Any]:
        """(the prompt's text or None, its token ids: `Engine.check_request` checks them)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"{where}: a text prompt needs a tokenizer and skip_tokenizer_init=True loads "
                    "none; give token ids (a list of ints or {'prompt_token_ids': [...]})"
                )
            if not prompt:
                raise ValueError(
                    f"{where}: the prompt is empty; allowed: a non-empty string, token ids or a "
                    "dict"
                )
            tok = self.tokenizer
            return prompt, tok.encode(prompt, add_bos=tok.bos_id is not None)
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), prompt["prompt_token_ids"]
            if "prompt" in prompt:
                return self._encode(prompt["prompt"], where)
            raise ValueError(
                f'{where}: {prompt!r} is not allowed: a dict needs "prompt_token_ids" or "prompt"'
            )
        return None, prompt

    @property
    def _model_name(self) -> str:
        return getattr(self.tokenizer, "name", "model")


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


def _architecture(config: ModelConfig):
    """The architecture ``config`` names (`dsv4.config.ModelConfig`), read from its preset or
    its checkpoint's config.json: no weights."""
    kind, path = model_source(config.model)  # the names load_pretrained and the CLI take
    if kind == "random":
        return MODEL_PRESETS[config.model].config(quant_sim=config.quant_sim)
    cfg = ArchConfig.from_json(
        shipped_checkpoint(config.model) if config.model in SHIPPED else path
    )
    return dataclasses.replace(cfg, quant_sim=True) if config.quant_sim else cfg


def _load_model(config: ModelConfig, cfg):
    """The architecture, params and tokenizer ``config`` names (``cfg``: its architecture; no
    tokenizer with ``skip_tokenizer_init``)."""
    jdtype = jnp.dtype(config.dtype)
    kind, path = model_source(config.model)
    if kind == "random":
        params = init_params(cfg, jax.random.PRNGKey(config.seed), jdtype)
        if config.weights_on_device == "released":
            params = quantise_params(params, cfg)
        tokenizer = None if config.skip_tokenizer_init else load_tokenizer(None, cfg)
        return cfg, params, tokenizer
    model = shipped_checkpoint(config.model) if config.model in SHIPPED else path
    # before the weights: its errors are cheap
    tokenizer = None if config.skip_tokenizer_init else load_tokenizer(model, cfg)
    cfg, params = load_pretrained(
        model, jdtype, config=cfg, progress=True, weights_on_device=config.weights_on_device
    )
    return cfg, params, tokenizer


def _render_chat(
    template: str, messages, add_generation_prompt: bool, tokenizer, where: str
) -> str:
    try:
        import jinja2.sandbox
    except ImportError as exc:  # pragma: no cover - jinja2 is in the test extra
        raise ImportError("chat templates need the jinja2 package: pip install jinja2") from exc
    if isinstance(messages, str | Mapping) or not isinstance(messages, Sequence) or not messages:
        raise ValueError(f"{where}={messages!r} is not allowed: a non-empty list of messages")
    for j, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("content"), str) or "role" not in m:
            raise ValueError(
                f'{where}[{j}]={m!r} is not allowed: a dict with "role" and a string "content"'
            )
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

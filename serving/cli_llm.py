"""The commands of ``dsv4`` that run the model, through `serving.LLM`:

* ``dsv4 demo`` (the README's ``make demo``): two rounds of generation with the shipped
  ``tiny_v41_trained`` model (a small V4.1 trained on the Python standard library; or
  ``--model tiny_v41`` for random weights, or ``--model PATH``): four Python snippets sharing a
  module header, then each one's continuation, whose prompt resends the first round (so it hits
  the prefix cache). It prints each output, the prefix-cache hits, TTFT and the tokens per
  second.
* ``dsv4 generate --prompt TEXT [--prompt ...]``: generate for the prompts and print each
  output with its finish reason and timings.
* ``dsv4 bench``: offline throughput on a synthetic multi-turn workload (conversations whose
  turns resend their history); prints one JSON line.

The engine flags are `serving.config`'s fields (`add_engine_arguments`: one ``--kebab-case``
flag per field, its default and help; older spellings such as ``--num-gpu-blocks`` and
``--sync`` kept), so the CLI builds the `EngineConfig` `LLM` builds from the same values. Every
flag is checked before JAX is imported (bad values exit with status 2, naming the flag, the
value and what is allowed).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import textwrap
import time
from collections.abc import Sequence

from dsv4.config import MODEL_PRESETS, model_source
from dsv4.config import ModelConfig as ArchConfig
from dsv4.tokenizer import load_tokenizer
from serving.config import (
    RANDOM_PRESETS,
    SHIPPED_MODELS,
    WEIGHTS_ON_DEVICE,
    ConfigError,
    EngineConfig,
    engine_fields,
)
from serving.sampling_params import SamplingParams

__all__ = [
    "HELP_FORMAT",
    "UsageError",
    "add_command",
    "add_commands",
    "add_engine_arguments",
    "engine_config",
    "flag_error",
]

_RANDOM = RANDOM_PRESETS  # seeded random weights
_SHIPPED = SHIPPED_MODELS
_WEIGHTS = WEIGHTS_ON_DEVICE  # dsv4.qweights.WEIGHTS_ON_DEVICE (it imports JAX)
# A module header every demo prompt shares (the prefix cache serves it after the first), then
# the start of four definitions; the model is trained on the standard library's source. Each
# prompt stops inside a line (a docstring or a call just opened): a byte-level BPE merges a
# newline with the indentation after it, so a prompt ending in a bare newline would be a
# tokenisation the model only saw before unindented code.
DEMO_SYSTEM = '''"""Small helpers for reading configuration files."""

import os
import sys


'''
DEMO_QUESTIONS = (
    'def read_lines(path):\n    """Return the lines of the file at *path*',
    'class ConfigError(Exception):\n    """',
    "def main(argv=None):\n    parser = argparse.ArgumentParser(",
    'def _split_key(line):\n    """Split',
)


# every parser's help shows each flag's default
HELP_FORMAT = argparse.ArgumentDefaultsHelpFormatter


class UsageError(Exception):
    """A bad command-line value; `serving.cli.main` reports it as argparse does (exit 2)."""


def add_command(sub, name: str, func, **kwargs) -> argparse.ArgumentParser:
    """The subcommand ``name`` of ``dsv4`` (``kwargs``: `add_parser`'s), run by ``func(args)``;
    its help shows each flag's default, and `serving.cli.main` reports its errors."""
    kwargs.setdefault("description", kwargs.get("help"))
    parser = sub.add_parser(name, formatter_class=HELP_FORMAT, **kwargs)
    parser.set_defaults(func=func, subparser=parser)
    return parser


class _EngineFlag(argparse.Action):
    """Stores an engine flag's value and the spelling that set it (errors name the flag as the
    user typed it)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, self.value(values, option_string))
        flags = getattr(namespace, "engine_flags", {})
        namespace.engine_flags = {**flags, self.dest: option_string}

    def value(self, values, option_string):
        return self.const if self.nargs == 0 else values


class _EngineSwitch(_EngineFlag):
    """A bool field's ``--flag`` / ``--no-flag`` (and its older positive spellings)."""

    def __init__(self, option_strings, dest, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def value(self, values, option_string):
        return not option_string.startswith("--no-")


def add_engine_arguments(group) -> None:
    """One flag per `serving.config.EngineConfig` field (``--kebab-case``, older spellings kept
    as aliases and negations), with the field's default and help."""
    for f in engine_fields():
        help_ = f.help.replace("%", "%%") + " (default: %(default)s)"
        if isinstance(f.default, bool):
            negative = "--no-" + f.flag[2:]
            flags = (f.flag, negative, *f.aliases)
            group.add_argument(*flags, action=_EngineSwitch, default=f.default, help=help_)
        else:
            plain_int = f.parse is None and f.choices is None and f.annotation.startswith("int")
            group.add_argument(
                f.flag,
                *f.aliases,
                action=_EngineFlag,
                default=f.default,
                type=int if plain_int else str,
                choices=f.choices,
                help=help_,
            )
        for flag, value in f.negations.items():
            same = "--no-" + f.flag[2:] if value is False else f"{f.flag} {str(value).lower()}"
            group.add_argument(
                flag,
                action=_EngineFlag,
                dest=f.name,
                nargs=0,
                const=value,
                default=argparse.SUPPRESS,  # the field's flag above sets and shows the default
                help=f"the same as {same}",
            )


def engine_config(args: argparse.Namespace):
    """The `serving.config.EngineConfig` the engine flags of ``args`` give (`LLM` builds the
    same from the same values).

    Raises:
        UsageError: a value out of range, naming the flag as typed, the value and the rule.
    """
    used = getattr(args, "engine_flags", {})
    kwargs = {}
    for f in engine_fields():
        value = getattr(args, f.name)
        if f.parse is not None and isinstance(value, str):
            try:
                value = f.parse(value)
            except ValueError as exc:
                raise _fail(used.get(f.name, f.flag), value, str(exc)) from None
        kwargs[f.name] = value
    try:
        return EngineConfig.from_kwargs(**kwargs)
    except ConfigError as exc:
        raise flag_error(args, exc) from None
    except ValueError as exc:  # the speculative config
        raise UsageError(str(exc)) from None


def flag_error(args: argparse.Namespace, exc: ConfigError) -> UsageError:
    """A `ConfigError` as the CLI reports it: the flag as typed, the value and the rule."""
    used = getattr(args, "engine_flags", {})
    field = next((f for f in engine_fields() if f.name == exc.name), None)
    flag = used.get(exc.name, field.flag if field else "--" + exc.name.replace("_", "-"))
    value = getattr(args, exc.name, exc.value)
    return _fail(flag, value if isinstance(value, str) else exc.value, exc.rule)


def add_commands(sub) -> None:
    """Register ``demo``, ``generate`` and ``bench`` on the ``dsv4`` subparsers."""
    engine = argparse.ArgumentParser(add_help=False, formatter_class=HELP_FORMAT)
    add_engine_arguments(engine.add_argument_group("model and engine"))

    def sampling(
        max_tokens: int, temperature: float = 0.0, top_p: float = 1.0
    ) -> argparse.ArgumentParser:
        # one parent per command: argparse shares a parent's actions, defaults included
        parser = argparse.ArgumentParser(add_help=False, formatter_class=HELP_FORMAT)
        s = parser.add_argument_group("sampling")
        s.add_argument(
            "--max-tokens", type=int, default=max_tokens, help="output tokens per prompt at most"
        )
        s.add_argument("--temperature", type=float, default=temperature, help="0 = greedy")
        s.add_argument("--top-p", type=float, default=top_p, help="nucleus mass (1 = off)")
        s.add_argument("--top-k", type=int, default=0, help="most likely tokens kept (0 = off)")
        return parser

    add_command(
        sub,
        "demo",
        _demo,
        # sampled (seeded by --seed, so the same every run): greedy decoding of a small model
        # repeats itself
        parents=[engine, sampling(48, temperature=0.7, top_p=0.95)],
        help="generation through LLM.generate: prefix hits, TTFT, tokens/s",
        description="Two rounds of generation with DeepSeek-V4.1 in JAX through LLM.generate: "
        "tiny_v41_trained writes Python in the style of the standard library it was trained "
        "on; with --model tiny_v41 (random weights) the text is gibberish, but every part of "
        "the model, the paged caches, the scheduler and the allocator run.",
    )

    gen = add_command(
        sub, "generate", _generate, parents=[engine, sampling(32)], help="generate text for prompts"
    )
    gen.add_argument(
        "--prompt", action="append", metavar="TEXT", required=True, help="a prompt (repeatable)"
    )
    gen.add_argument("--n", type=int, default=1, help="samples per prompt")
    gen.add_argument(
        "--logprobs", type=int, default=None, help="top logprobs per token (at most --max-logprobs)"
    )

    bench = add_command(
        sub,
        "bench",
        _bench,
        parents=[engine, sampling(16)],
        help="offline throughput (one JSON line)",
    )
    bench.add_argument("--conversations", type=int, default=8, help="conversations at once")
    bench.add_argument("--turns", type=int, default=3, help="turns per conversation")
    bench.add_argument("--system-tokens", type=int, default=48, help="shared system prompt")
    bench.add_argument("--user-tokens", type=int, default=24, help="per turn (at most)")


def _fail(flag: str, value, allowed: str) -> Exception:
    return UsageError(f"{flag} {value!r}: {allowed}")


def _check(args: argparse.Namespace) -> None:
    """Reject bad values before anything expensive (JAX, params) happens; the engine's flags
    become ``args.engine_config``."""
    args.engine_config = engine_config(args)
    if args.engine_config.model_config.skip_tokenizer_init:
        raise UsageError(
            "--skip-tokenizer-init: this command works on text, which needs the tokenizer "
            "(dsv4 serve takes token-id prompts without one)"
        )
    if args.max_tokens < 1:
        raise _fail("--max-tokens", args.max_tokens, "must be >= 1")
    if not args.temperature >= 0:
        raise _fail("--temperature", args.temperature, "must be >= 0 (0 = greedy)")
    if not 0 < args.top_p <= 1:
        raise _fail("--top-p", args.top_p, "must be in (0, 1]")
    if args.top_k < -1:
        raise _fail("--top-k", args.top_k, "must be -1 or 0 (off) or >= 1")
    for flag in ("n", "conversations", "turns", "system_tokens", "user_tokens"):
        value = getattr(args, flag, 1)
        if value < 1:
            raise _fail("--" + flag.replace("_", "-"), value, "must be >= 1")
    most = args.engine_config.model_config.max_logprobs
    if getattr(args, "logprobs", None) is not None and not 0 <= args.logprobs <= most:
        raise _fail("--logprobs", args.logprobs, f"must be in 0..{most} (--max-logprobs {most})")
    for prompt in getattr(args, "prompt", None) or ():
        if prompt == "":
            raise _fail("--prompt", prompt, "must not be empty")
    if getattr(args, "n", 1) > 1 and args.temperature == 0:
        raise _fail("--n", args.n, "needs --temperature > 0 (greedy samples are identical)")
    _check_lengths(args)


def _check_lengths(args: argparse.Namespace) -> None:
    """--max-model-len and each --prompt against the model, read from its config and tokenizer
    (no JAX, no weights)."""
    model = args.engine_config.model_config
    try:
        kind, path = model_source(model.model)
        cfg = (
            MODEL_PRESETS[model.model].config() if kind == "random" else ArchConfig.from_json(path)
        )
    except ValueError as exc:
        raise UsageError(f"--model {model.model!r}: {exc}") from None
    limit = model.max_model_len or cfg.max_seq_len
    if limit > cfg.max_seq_len:
        raise _fail("--max-model-len", limit, f"at most the model's max_seq_len {cfg.max_seq_len}")
    if hasattr(args, "user_tokens"):  # dsv4 bench: its longest conversation, before it runs
        s, t, u, m = args.system_tokens, args.turns, args.user_tokens, args.max_tokens
        if s + t * (u + m) > limit:
            raise _fail(
                "--turns",
                t,
                f"the conversations can reach {s + t * (u + m)} tokens (--system-tokens {s} + "
                f"--turns {t} x (--user-tokens {u} + --max-tokens {m})), more than "
                f"--max-model-len {limit}: lower one of them",
            )
    prompts = getattr(args, "prompt", None) or ()
    try:
        tokenizer = load_tokenizer(path, cfg) if prompts else None
    except ValueError as exc:  # a tokenizer that does not fit the config
        raise UsageError(f"--model {model.model!r}: {exc}") from None
    for i, prompt in enumerate(prompts):
        n = len(tokenizer.encode(prompt, add_bos=tokenizer.bos_id is not None))
        if n >= limit:
            shown = prompt if len(prompt) <= 40 else prompt[:37] + "..."
            raise _fail(
                f"--prompt #{i + 1}",
                shown,
                f"{n} tokens; at most {limit - 1} (--max-model-len {limit} leaves room for one "
                "output token)",
            )


def _llm(args: argparse.Namespace):
    from serving.llm import LLM  # reason: it imports JAX; flags are checked before it starts

    try:
        return LLM(**args.engine_config.to_kwargs())
    except ConfigError as exc:  # e.g. a pool too small for one request: by its flag
        raise flag_error(args, exc) from None
    except ValueError as exc:  # a checkpoint or engine argument it cannot use
        raise UsageError(str(exc)) from None


def _sampling(args: argparse.Namespace, **extra):

    try:
        return SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            max_tokens=args.max_tokens,
            seed=args.seed if args.temperature > 0 else None,
            **extra,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from exc


def _outputs(llm, prompts: list, sp) -> list:
    """``llm.generate``; what only the loaded model can check (a prompt too long for
    --max-model-len after earlier rounds grew it) becomes a usage error."""
    try:
        return llm.generate(prompts, sp, use_tqdm=False)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _say(line: str = "") -> None:
    """print, falling back to backslash escapes on a terminal that cannot show a character."""
    try:
        print(line, flush=True)
    except UnicodeEncodeError:
        enc = sys.stdout.encoding or "ascii"
        print(line.encode(enc, "backslashreplace").decode(enc), flush=True)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.1f} ms"


def _header(llm) -> None:
    import jax  # reason: the model commands import JAX only once their flags are checked

    from dsv4.params import count_params  # reason: as jax

    cfg = llm.cfg
    backbone = count_params(cfg, drafter=False)
    drafter = count_params(cfg) - backbone
    config = llm.engine.kv_cache_manager.kv_cache_config
    st = llm.engine.stats
    _say(
        f"model: {backbone:,} parameters"
        + (f" (and {drafter:,} in its DSpark drafter)" if drafter else "")
        + f", {cfg.n_layers} layers, vocab {cfg.vocab_size}; tokenizer "
        f"{llm.get_tokenizer().name}; JAX {jax.default_backend()}"
    )
    _say(
        f"engine: {'async' if llm.engine.async_scheduling else 'sync'} scheduling, KV cache "
        f"{llm.kv_cache_dtype} records in {config.num_blocks} blocks, token buckets "
        f"{llm.engine.runner.token_buckets}; warm-up {st.warm_up_s:.1f} s: "
        f"{st.warm_up_programs} programs ({st.warm_up_compilations} compiled, "
        f"{st.warm_up_cache_hits} loaded from the persistent compilation cache)"
    )


def _demo(args: argparse.Namespace) -> int:
    """Two rounds: the second resends the first round's prompts and outputs (prefix hits)."""
    _check(args)
    llm = _llm(args)
    if args.model in _RANDOM:
        _say(
            f"DeepSeek-V4.1 demo: {args.model} with random weights (seed {args.seed}): the text "
            "is gibberish; the point is the machinery. Pass --model PATH for real weights."
        )
    elif args.model in _SHIPPED:
        _say(
            f"DeepSeek-V4.1 demo: {args.model}, the shipped small V4.1 trained on the Python "
            "standard library (benchmarks.quality gives its held-out bits per byte): it "
            "continues Python code."
        )
    _header(llm)
    sp = _sampling(args)
    _say("Every prompt starts with this module header (the prefix cache serves it after the "
         "first):")  # fmt: skip
    _say(_lines(DEMO_SYSTEM.rstrip("\n"), "    > "))
    histories = [DEMO_SYSTEM + q for q in DEMO_QUESTIONS]
    t0 = time.perf_counter()
    tokens = 0
    for round_ in (1, 2):
        outs = _outputs(llm, histories, sp)
        if round_ == 1:
            _say(f"-- round 1: {len(outs)} prompts in one batch, each the header and a snippet")
        else:
            _say("-- round 2: each round-1 prompt with its completion, sent again as one batch "
                 "(a chat's next turn)")  # fmt: skip
        for i, out in enumerate(outs):
            tokens += len(out.outputs[0].token_ids)
            _demo_output(args, i, round_, out)
        histories = [h + o.outputs[0].text for h, o in zip(histories, outs)]
    wall = time.perf_counter() - t0
    st = llm.engine.stats
    _say(
        f"total: {tokens} output tokens in {wall:.2f} s = {tokens / wall:.1f} tokens/s; "
        f"prefix-cache hit rate {100 * st.prefix_cache_hit_rate:.1f} % "
        f"({st.prefix_cache_hits} of {st.prefix_cache_queries} prompt tokens); "
        f"{st.num_preemptions} preemptions; {st.compilations_after_warm_up} compilations after "
        "warm-up"
    )
    return 0


def _lines(text: str, prefix: str, first: str | None = None) -> str:
    """``text`` with ``prefix`` before each line (``first`` before the first one)."""
    out = textwrap.indent(text, prefix, lambda line: True).rstrip("\n")
    return out if first is None else first + out[len(prefix) :]


def _demo_output(args: argparse.Namespace, i: int, round_: int, out) -> None:
    """One request of the demo: its figures, then its prompt beside its completion."""
    c = out.outputs[0]
    _say(
        f"[{i}] {len(out.prompt_token_ids)} prompt tokens ({out.num_cached_tokens} from the "
        f"prefix cache); time to first token {_ms(out.metrics.ttft)}, time per output token "
        f"{_ms(out.metrics.tpot)}; {len(c.token_ids)} output tokens ({c.finish_reason})"
    )
    if round_ == 1:
        prompt = _lines(DEMO_QUESTIONS[i], "               > ", "    prompt     > ")
    else:
        prompt = f"    prompt     > round 1's [{i}]: its prompt and completion"
    _say(prompt)
    if args.model in _RANDOM:  # gibberish: escaped
        _say(f"    completion | {c.text!r}")
    else:
        _say(_lines(c.text, "               | ", "    completion | "))


def _generate(args: argparse.Namespace) -> int:
    _check(args)
    llm = _llm(args)
    _header(llm)
    sp = _sampling(args, n=args.n, logprobs=args.logprobs)
    t0 = time.perf_counter()
    outs = _outputs(llm, list(args.prompt), sp)
    wall = time.perf_counter() - t0
    tokens = 0
    for i, out in enumerate(outs):
        _say(f"[{i}] prompt: {out.prompt!r} ({len(out.prompt_token_ids)} tokens)")
        for c in out.outputs:
            tokens += len(c.token_ids)
            tag = f" #{c.index}" if len(out.outputs) > 1 else ""
            _say(f"    output{tag}: {c.text!r} ({len(c.token_ids)} tokens, {c.finish_reason})")
            if c.logprobs:
                lp = ", ".join(f"{e[t].logprob:.2f}" for t, e in zip(c.token_ids, c.logprobs))
                _say(f"    logprobs: [{lp}]")
        _say(f"    TTFT {_ms(out.metrics.ttft)}, TPOT {_ms(out.metrics.tpot)}")
    _say(f"{tokens} tokens in {wall:.2f} s = {tokens / wall:.1f} tokens/s")
    return 0


def _percentiles(values: Sequence[float]) -> dict[str, float | None]:
    import numpy as np

    if not values:
        return {"p50": None, "p90": None, "p99": None}
    arr = np.asarray(values) * 1000
    return {f"p{q}": round(float(np.percentile(arr, q)), 3) for q in (50, 90, 99)}


def _bench(args: argparse.Namespace) -> int:
    """Turn k of every conversation in one LLM.generate call, k = 1..turns: each prompt is
    the system prompt plus the conversation so far plus a new user message."""
    _check(args)
    llm = _llm(args)
    t0 = time.perf_counter()
    outputs = _bench_turns(args, llm)
    result = _bench_result(args, llm, outputs, time.perf_counter() - t0)
    print(json.dumps(result, sort_keys=True))
    return 0


def _bench_turns(args: argparse.Namespace, llm) -> list:
    """Run the conversations turn by turn; every turn's outputs."""
    rng = random.Random(args.seed)
    vocab = llm.cfg.vocab_size

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    system = tokens(args.system_tokens)
    histories = [list(system) for _ in range(args.conversations)]
    sp = _sampling(args, ignore_eos=True)
    outputs = []
    for _ in range(args.turns):
        for h in histories:
            h += tokens(rng.randint(1, args.user_tokens))
        outs = _outputs(llm, histories, sp)
        outputs += outs
        for h, o in zip(histories, outs, strict=True):
            h += o.outputs[0].token_ids
    return outputs


def _bench_result(args: argparse.Namespace, llm, outputs: list, wall: float) -> dict:
    """The figures `dsv4 bench` prints (one JSON object)."""
    st = llm.engine.stats
    gen = sum(len(o.outputs[0].token_ids) for o in outputs)
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    return {
        "benchmark": "dsv4 bench",
        "model": args.model,
        "dtype": args.dtype,
        "kv_cache_dtype": llm.kv_cache_dtype,
        "async_scheduling": args.async_scheduling,
        "num_scheduler_steps": llm.config.scheduler_config.num_scheduler_steps,
        "requests": len(outputs),
        "prompt_tokens": prompt,
        "output_tokens": gen,
        "wall_s": round(wall, 3),
        "output_tokens_per_s": round(gen / wall, 2),
        "total_tokens_per_s": round((gen + prompt) / wall, 2),
        "requests_per_s": round(len(outputs) / wall, 3),
        "ttft_ms": _percentiles([o.metrics.ttft for o in outputs]),
        "tpot_ms": _percentiles([o.metrics.tpot for o in outputs if o.metrics.tpot]),
        "prefix_cache_hit_rate": round(st.prefix_cache_hit_rate, 4),
        "preemptions": st.num_preemptions,
        "steps": st.num_steps,
        "host_ms_per_step": round(1000 * st.host_s / max(st.num_steps, 1), 3),
        "warm_up_s": round(st.warm_up_s, 2),
        "warm_up_compilations": st.warm_up_compilations,
        "warm_up_cache_hits": st.warm_up_cache_hits,
        "compilations_after_warm_up": st.compilations_after_warm_up,
        "python": platform.python_version(),
    }

"""The ``dsv4`` command line.

``dsv4 demo``, ``dsv4 generate`` and ``dsv4 bench`` run the model through `serving.LLM`
(`serving.cli_llm`): the seeded ``tiny_v41`` model with random weights, or a released-format
checkpoint given with ``--model PATH``.
``dsv4 cache-demo`` walks multi-turn conversations, one turn at a time, through the scheduler
(``serving.scheduler.Scheduler``) and the KV-cache allocator on the V4.1 cache layout, with made-up
tokens. ``dsv4 layout`` prints the layout and its memory report. ``dsv4 lab`` runs cache-layout
experiments (`lab.cli`). ``dsv4 plan`` prints the memory planner's per-chip bytes of a
slice (`planner.plan`).

JAX is imported only by the model commands, so ``cache-demo`` and ``layout`` start instantly.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import re
import sys
from collections.abc import Sequence

from cache import KVCacheManager, Request
from cache.layout import (
    ModelCacheDesc,
    blocks_per_request,
    for_model,
    memory_report,
    pool_bytes_per_block,
    tiny_v41_desc,
    v41_flash_desc,
)
from cache.spec import KVCacheConfig, iter_layer_specs
from dsv4.config import MODEL_PRESETS
from lab.cli import add_lab_command
from serving.cli_llm import (
    HELP_FORMAT,
    UsageError,
    add_command,
    add_commands,
    add_engine_arguments,
    engine_config,
)
from serving.config import VLLM_ONLY, SchedulerConfig, engine_fields
from serving.sampling_params import BEST_OF_ADVICE, VLLM_ONLY_SAMPLING
from serving.scheduler import Scheduler

# `dsv4 layout` / `cache-demo --model`: the model names of the one preset table, and the short
# names these commands took before (flash, tiny)
_ALIASES = {"flash": "v41_flash", "tiny": "tiny_v41"}
_LAYOUT_MODELS = (*MODEL_PRESETS, *_ALIASES)

# What `dsv4 cache-demo` makes up: tokens of each user message and of each answer (inclusive
# ranges), and the fake token ids (half-open).
_USER_TOKENS = (40, 400)
_OUTPUT_TOKENS = (16, 200)
_TOKEN_IDS = (1000, 50_000)


def _desc(args: argparse.Namespace) -> ModelCacheDesc:
    """The named model's cache layout: V4.1-Flash with SM90 records; a tiny preset's layer plan
    (read from its config, no JAX) with `tiny_v41_desc`'s bf16 records and block sizes."""
    name = _ALIASES.get(args.model, args.model)
    k = args.num_speculative_tokens
    if name == "v41_flash":
        return v41_flash_desc(num_speculative_tokens=k)
    records = dataclasses.asdict(tiny_v41_desc(num_speculative_tokens=k))
    del records["num_draft_layers"]  # from the config's ratios past its backbone
    plan = MODEL_PRESETS[name].config().to_hf_dict()["text_config"]
    return ModelCacheDesc.from_config({**records, **plan})


def _group_names(config: KVCacheConfig) -> list[str]:
    names = []
    for group in config.kv_cache_groups:
        first = iter_layer_specs(group.kv_cache_spec)[0]
        kind = type(first).__name__.removesuffix("Spec")
        names.append(f"{kind}[{len(group.layer_names)}]")
    return names


# -- argument checks shared by cache-demo and layout ------------------------------------------


def _check_at_least(flag: str, value: int, minimum: int) -> None:
    if value < minimum:
        raise UsageError(f"{flag} must be >= {minimum}, got {value}")


def _check_common_args(args: argparse.Namespace) -> None:
    """The flags `cache-demo` and `layout` share."""
    _check_at_least("--max-model-len", args.max_model_len, 1)
    _check_at_least("--max-num-batched-tokens", args.max_num_batched_tokens, 1)
    _check_at_least("--num-speculative-tokens", args.num_speculative_tokens, 0)


# -- dsv4 layout -------------------------------------------------------------------------------


def _check_layout_args(args: argparse.Namespace) -> None:
    """Reject bad values before the layout is sized."""
    _check_common_args(args)
    gib = args.memory_gib
    if not (math.isfinite(gib) and gib > 0):  # also NaN
        raise UsageError(f"--memory-gib must be a finite number > 0, got {gib}")
    per_block = pool_bytes_per_block(
        for_model(_desc(args), num_gpu_blocks_override=1).kv_cache_groups, packed_layout=True
    )
    if int(gib * 2**30) < per_block:
        raise UsageError(
            f"--memory-gib {gib} holds no pool block: one block of the {args.model} layout "
            f"takes {per_block} B ({per_block / 2**30:.3g} GiB)"
        )


def _layout(args: argparse.Namespace) -> int:
    _check_layout_args(args)
    config = for_model(_desc(args), available_memory_bytes=int(args.memory_gib * 2**30))
    print(
        memory_report(config, args.max_model_len, args.max_num_batched_tokens, packed_layout=True)
    )
    return 0


# -- dsv4 plan ---------------------------------------------------------------------------------


def _check_plan_args(args: argparse.Namespace):
    """Parse the slices and the mesh; reject bad values with the flag and the value."""
    from planner import plan as P  # reason: imports JAX; the other commands start without it

    _check_at_least("--max-num-seqs", args.max_num_seqs, 1)
    _check_at_least("--max-model-len", args.max_model_len, 1)
    _check_at_least("--max-num-batched-tokens", args.max_num_batched_tokens, 1)
    if not (math.isfinite(args.headroom) and 0 <= args.headroom < 1):
        raise UsageError(f"--headroom must be in [0, 1), got {args.headroom}")
    if args.compiled and args.markdown:
        raise UsageError("--compiled adds to the text or --json output; --markdown is the table")
    try:
        slices = [P.parse_slice(c) for c in args.chips]
        mesh = None if args.mesh is None else P.parse_mesh(args.mesh)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return slices, mesh


def _plan(args: argparse.Namespace) -> int:
    """Per-chip weights, KV pages per group, activations and the largest batch per slice."""
    slices, mesh = _check_plan_args(args)
    from planner import plan as P  # reason: as in _check_plan_args

    cfg = P.MODELS[args.model]()
    plans = []
    for slice_ in slices:
        try:
            plans.append(
                P.plan(
                    cfg,
                    slice_,
                    mesh=mesh,
                    max_num_seqs=args.max_num_seqs,
                    max_model_len=args.max_model_len,
                    max_num_batched_tokens=args.max_num_batched_tokens,
                    records=args.records,
                    headroom=args.headroom,
                )
            )
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    if args.markdown:
        print(P.markdown_table(plans))
        return 0
    # the compiled check: the 40-layer model takes too long to compile on a CPU; its 6-layer
    # version has the same widths, experts and rules
    compile_cfg = P.reduced_flash() if args.model == "v41_flash" else cfg
    for p in plans:
        compiled = P.compiled_check(compile_cfg, p) if args.compiled else None
        if args.json:
            extra = {} if compiled is None else {"compiled": compiled}
            print(json.dumps({"model": args.model, **p.as_dict(), **extra}, sort_keys=True))
        else:
            print(P.describe(p, args.model))
            if compiled is not None:
                print(P.describe_compiled(compiled))
    return 0


# -- dsv4 cache-demo ---------------------------------------------------------------------------


def _longest_prompt(args: argparse.Namespace) -> int:
    """Most tokens a turn's prompt can have: the system prompt, every user message and every
    earlier answer at their longest."""
    user, answers = args.turns * _USER_TOKENS[1], (args.turns - 1) * _OUTPUT_TOKENS[1]
    return args.system_tokens + user + answers


def _check_cache_demo_args(args: argparse.Namespace) -> None:
    """Reject bad values before any conversation runs."""
    _check_common_args(args)
    _check_at_least("--conversations", args.conversations, 1)
    _check_at_least("--turns", args.turns, 1)
    _check_at_least("--system-tokens", args.system_tokens, 0)
    _check_at_least("--chunk-tokens", args.chunk_tokens, 1)
    _check_at_least("--num-blocks", args.num_blocks, 2)  # the null block and one more
    longest = _longest_prompt(args)
    if args.max_model_len <= longest:
        raise UsageError(
            f"--max-model-len must be > {longest} (the longest prompt: --system-tokens "
            f"{args.system_tokens} + --turns {args.turns} x {_USER_TOKENS[1]} user tokens + "
            f"{args.turns - 1} x {_OUTPUT_TOKENS[1]} answer tokens), got {args.max_model_len}"
        )
    # One turn runs at a time and finished turns' blocks stay evictable, so the pool must
    # hold one request of the longest conversation (plus its lookahead slots).
    num_tokens = longest + _OUTPUT_TOKENS[1] + args.num_speculative_tokens
    num_tokens = min(num_tokens, args.max_model_len)
    groups = for_model(_desc(args), num_gpu_blocks_override=1).kv_cache_groups
    need = 1 + sum(
        blocks_per_request(group, num_tokens, args.max_num_batched_tokens) for group in groups
    )
    if args.num_blocks < need:
        raise UsageError(
            f"--num-blocks must be >= {need} (the null block plus what one request of up to "
            f"{num_tokens} tokens takes in the {args.model} layout's {len(groups)} groups), "
            f"got {args.num_blocks}"
        )


@dataclasses.dataclass(frozen=True, slots=True)
class _TurnReport:
    num_hit_tokens: int  # prefix-cache hit at admission (replayed tokens included)
    blocks_held: list[int]  # per KV-cache group, at the turn's last step
    usage: float  # pool usage at the turn's last step


def _run_turn(scheduler: Scheduler, request: Request, rng: random.Random) -> _TurnReport:
    """Run one request alone through ``scheduler`` until it finishes, sampling fake tokens.

    Returns what the turn cost, measured after its last step was planned (its blocks are
    freed when it finishes).

    Raises:
        UsageError: the pool cannot hold the request (``--num-blocks`` too small).
    """
    manager = scheduler.kv_cache_manager
    request_id = request.request_id
    scheduler.add_request(request)
    num_hit_tokens = None
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        if not output.num_scheduled_tokens:
            raise UsageError(
                f"--num-blocks {manager.kv_cache_config.num_blocks} is too small: {request_id} "
                f"({request.num_tokens} tokens) does not fit into the pool"
            )
        for new in output.scheduled_new_reqs:
            if num_hit_tokens is None:  # a resumed request's hits are its own earlier work
                num_hit_tokens = new.num_computed_tokens + new.num_replay_tokens
        held = [sum(not b.is_null for b in g) for g in manager.get_blocks(request_id).blocks]
        usage = manager.usage
        sampled = {i: [rng.randrange(*_TOKEN_IDS)] for i in output.sampling_req_ids}
        scheduler.update_from_output(output, sampled)
    return _TurnReport(num_hit_tokens or 0, held, usage)


def _cache_demo(args: argparse.Namespace) -> int:
    """Multi-turn chats, one turn at a time, through the Scheduler and the allocator."""
    _check_cache_demo_args(args)
    config = for_model(_desc(args), num_gpu_blocks_override=args.num_blocks)
    mgr = KVCacheManager(
        config,
        args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        swa_bounded_replay=args.bounded_replay,
        use_eagle=args.num_speculative_tokens > 0,
    )
    scheduler = Scheduler(
        mgr,
        SchedulerConfig(
            max_num_seqs=1,
            max_num_batched_tokens=args.max_num_batched_tokens,
            async_scheduling=False,
            long_prefill_token_threshold=args.chunk_tokens,
        ),
        max_model_len=args.max_model_len,
        num_spec_tokens=args.num_speculative_tokens,
        # DSpark writes KV for its drafts: reserve their slots (no drafts are proposed here).
        num_lookahead_tokens=args.num_speculative_tokens,
    )
    names = _group_names(config)
    print(
        f"DeepSeek-V4.1 {args.model} cache layout: {len(names)} KV-cache groups {names}; "
        f"{config.num_blocks} blocks; scheduler block {mgr.scheduler_block_size} tokens, "
        f"hash block {mgr.hash_block_size} tokens"
        + (", SWA bounded replay" if args.bounded_replay else "")
    )
    rng = random.Random(args.seed)
    system = [rng.randrange(*_TOKEN_IDS) for _ in range(args.system_tokens)]
    total_prompt = total_hits = 0
    for conv in range(args.conversations):
        history = list(system)
        for turn in range(args.turns):
            history += [rng.randrange(*_TOKEN_IDS) for _ in range(rng.randint(*_USER_TOKENS))]
            num_output_tokens = rng.randint(*_OUTPUT_TOKENS)
            req = mgr.new_request(f"c{conv}t{turn}", history, max_tokens=num_output_tokens)
            report = _run_turn(scheduler, req, rng)
            hits = report.num_hit_tokens
            print(
                f"conversation {conv} turn {turn}: prompt {req.num_prompt_tokens:5d} tokens, "
                f"hit {hits:5d} ({hits / req.num_prompt_tokens:4.0%}), "
                f"output {req.num_output_tokens:3d}; blocks held per group "
                f"{report.blocks_held}; pool usage {report.usage:.1%}"
            )
            total_prompt += req.num_prompt_tokens
            total_hits += hits
            history = list(req.all_token_ids)
    print(
        f"prefix-cache hit rate over {args.conversations * args.turns} turns: "
        f"{total_hits / total_prompt:.1%} of {total_prompt} prompt tokens"
    )
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse, with every user error on one line of stderr (exit status 2, no usage dump):
    ``dsv4 generate: error: --max-tokens 0: must be >= 1 (dsv4 generate --help)``."""

    def error(self, message: str):
        message += _vllm_hint(message)
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _vllm_hint(message: str) -> str:
    """For an unrecognized vLLM flag (``--gpu-memory-utilization``, ``--best-of``): what to
    use instead, from the tables `LLM` and `SamplingParams` refuse its keyword by."""
    if not message.startswith("unrecognized arguments: "):
        return ""
    advice = {**VLLM_ONLY, **VLLM_ONLY_SAMPLING, "best_of": BEST_OF_ADVICE}
    for word in message.split()[2:]:
        name = word.partition("=")[0].removeprefix("--").replace("-", "_")
        if word.startswith("--") and name in advice:
            text = advice[name]
            for field in engine_fields():  # the keywords it names, as flags
                text = text.replace(f"{field.name}=False", "--no-" + field.flag[2:])
                text = re.sub(rf"\b{field.name}\b(?!=)", field.flag, text)
            return f"; {word.partition('=')[0]} is vLLM's, not supported here: {text}"
    return ""


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dsv4-jax")
    except PackageNotFoundError:  # a source tree that is not installed
        return "unknown (not installed)"


def api_key(args: argparse.Namespace) -> str | None:
    """``dsv4 serve``'s key: ``--api-key``, else ``$DSV4_API_KEY``, else None (no key asked)."""
    return getattr(args, "api_key", None) or os.environ.get("DSV4_API_KEY") or None


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="dsv4",
        description="DeepSeek-V4.1 in JAX: run the model (demo, generate, bench, serve), explore "
        "its KV-cache layout (cache-demo, layout, lab) and plan a slice's memory (plan).",
        epilog="dsv4 COMMAND --help lists a command's flags with their defaults.",
        formatter_class=HELP_FORMAT,
    )
    parser.add_argument("--version", action="version", version=f"dsv4 {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    add_commands(sub)

    _add_layout_commands(sub)
    _add_plan_command(sub)
    _add_serve_command(sub)
    add_lab_command(sub, UsageError)
    for command in sub.choices.values():  # lab's too: every flag's help shows its default
        command.formatter_class = HELP_FORMAT
    return parser


def _add_layout_commands(sub) -> None:
    """``cache-demo`` and ``layout``: the allocator and the cache layout, no model."""
    common = argparse.ArgumentParser(add_help=False, formatter_class=HELP_FORMAT)
    common.add_argument(
        "--model",
        choices=_LAYOUT_MODELS,
        default="v41_flash",
        help="a model name (as LLM and dsv4 plan take them; flash and tiny are short for "
        "v41_flash and tiny_v41)",
    )
    _add_sizes(common, max_model_len=65_536)
    common.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=0,
        help="DSpark draft tokens per step (ring sizes, lookahead slots)",
    )

    cache_demo = add_command(
        sub,
        "cache-demo",
        _cache_demo,
        parents=[common],
        help="multi-turn chats through the KV-cache allocator",
    )
    cache_demo.add_argument(
        "--conversations", type=int, default=3, help="chats, run one after another"
    )
    cache_demo.add_argument("--turns", type=int, default=3, help="turns per chat")
    cache_demo.add_argument(
        "--system-tokens", type=int, default=1500, help="system prompt every chat shares"
    )
    cache_demo.add_argument(
        "--chunk-tokens",
        type=int,
        default=2048,
        help="most prompt tokens a request gets per step (vLLM long_prefill_token_threshold)",
    )
    cache_demo.add_argument("--num-blocks", type=int, default=4096, help="KV-cache pool blocks")
    cache_demo.add_argument("--bounded-replay", action="store_true", help="V4.1 SWA bounded replay")
    cache_demo.add_argument("--seed", type=int, default=0, help="the made-up tokens")

    layout = add_command(
        sub, "layout", _layout, parents=[common], help="print the cache layout and its memory"
    )
    layout.add_argument("--memory-gib", type=float, default=16.0, help="memory for the pool")


def _add_sizes(parser: argparse.ArgumentParser, max_model_len: int) -> None:
    """The request and step sizes every layout and plan command takes."""
    parser.add_argument(
        "--max-model-len", type=int, default=max_model_len, help="most tokens a request may hold"
    )
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="token budget of one step"
    )


def _add_plan_command(sub) -> None:
    plan = add_command(
        sub,
        "plan",
        _plan,
        help="per-chip bytes of weights, KV pages and activations on a slice (no devices)",
        description="The memory planner (planner.plan): per chip, the weights at the released "
        "formats (and dequantised to bf16), the KV pages per group and the step's activations, "
        "and the most requests that fit, per context length.",
    )
    plan.add_argument(
        "--model", choices=list(MODEL_PRESETS), default="v41_flash", help="the model to plan"
    )
    plan.add_argument(
        "--chips",
        nargs="+",
        default=["h200x8"],
        help="slices: v5e-N, v6e-N (N chips), v5p-N (N TensorCores = N/2 chips), h100xN, h200xN",
    )
    plan.add_argument(
        "--mesh", default=None, help="data=D,expert=E,model=M (None: the best that fits)"
    )
    plan.add_argument("--max-num-seqs", type=int, default=64, help="requests served at once")
    _add_sizes(plan, max_model_len=131_072)
    plan.add_argument(
        "--records",
        default=None,
        help="KV record preset: EXACT, BF16, RELEASED, RELEASED_FP8, SM90 (None: the chip's)",
    )
    plan.add_argument("--headroom", type=float, default=0.1, help="fraction of HBM left unplanned")
    plan.add_argument(
        "--compiled",
        action="store_true",
        help="also XLA's memory of a deviceless compile on TPU slices (libtpu; minutes)",
    )
    out = plan.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="one JSON line per slice")
    out.add_argument("--markdown", action="store_true", help="the table of docs/planner.md")


# -- dsv4 serve --------------------------------------------------------------------------------


def _add_serve_command(sub) -> None:
    serve = add_command(
        sub,
        "serve",
        _serve,
        help="an OpenAI-compatible HTTP server (docs/server.md)",
        description="Serve the model over HTTP with OpenAI's API (/v1/completions, "
        "/v1/chat/completions, /v1/models, /tokenize, /detokenize, /health, /metrics); one "
        "engine batches every client's requests. Needs the serve extra (fastapi, uvicorn).",
    )
    serve.add_argument(
        "model_tag",
        nargs="?",
        metavar="MODEL",
        help="as --model (a preset or a checkpoint dir; None: --model's)",
    )
    s = serve.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", type=int, default=8000, help="port (0: a free one)")
    s.add_argument(
        "--api-key",
        default=argparse.SUPPRESS,  # read from the environment when serving: --help never shows it
        help="clients must send Authorization: Bearer KEY (default: $DSV4_API_KEY, else none)",
    )
    s.add_argument("--served-model-name", default=None, help="the model's name in the API")
    s.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="sequences that may wait beyond --max-num-seqs; more get 503 (None: no limit)",
    )
    s.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds SIGTERM waits for running requests to finish",
    )
    add_engine_arguments(serve.add_argument_group("model and engine"))


def serve_kwargs(config) -> dict:
    """The `LLM` keywords `dsv4 serve` builds its engine with: ``config``'s, one step a program
    unless ``--num-scheduler-steps`` says otherwise (a stream wants each token as it comes, an
    arrival no wait for a burst; `LLM` alone runs bursts)."""
    kwargs = config.to_kwargs()
    if kwargs["num_scheduler_steps"] is None:
        kwargs["num_scheduler_steps"] = 1
    return kwargs


def _serve(args: argparse.Namespace) -> int:
    """Check the flags, build and warm up the engine, serve until SIGTERM."""
    if args.model_tag is not None:
        typed = getattr(args, "engine_flags", {}).get("model")
        if typed is not None and args.model != args.model_tag:
            raise UsageError(f"MODEL {args.model_tag!r} and {typed} {args.model!r} disagree")
        args.model = args.model_tag
    config = engine_config(args)
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port {args.port}: must be in 0..65535")
    if args.max_waiting_requests is not None and args.max_waiting_requests < 0:
        raise UsageError(f"--max-waiting-requests {args.max_waiting_requests}: must be >= 0")
    if not args.shutdown_timeout >= 0:
        raise UsageError(f"--shutdown-timeout {args.shutdown_timeout}: must be >= 0")
    try:
        from serving import server  # reason: FastAPI, uvicorn and JAX load only to serve
    except ImportError as exc:
        raise UsageError(
            f"dsv4 serve needs the serve extra ({exc}): pip install 'dsv4-jax[serve]'"
        ) from exc
    from serving.llm import LLM  # reason: imports JAX; the flags are checked first

    try:
        llm = LLM(**serve_kwargs(config))
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    options = server.ServerOptions(
        served_model_name=args.served_model_name or args.model,
        api_key=api_key(args),
        max_waiting_requests=args.max_waiting_requests,
    )
    return server.run_server(
        llm, options, host=args.host, port=args.port, shutdown_timeout=args.shutdown_timeout
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except UsageError as exc:
        # one line, "dsv4 demo: error: ...", exit status 2
        args.subparser.error(str(exc))
    return 2  # pragma: no cover - error() exits


if __name__ == "__main__":
    sys.exit(main())

"""The ``dsv4`` command line.

``dsv4 demo`` walks a few multi-turn conversations through the KV-cache allocator on the
DeepSeek-V4.1 cache layout and prints, per turn, the prefix-cache hit and the blocks each
KV-cache group holds. ``dsv4 layout`` prints the layout and its memory report.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Sequence

from cache import KVCacheManager, Request
from cache.layout import ModelCacheDesc, for_model, memory_report, tiny_v41_desc, v41_flash_desc
from cache.spec import KVCacheConfig, iter_layer_specs

_DESCS = {"flash": v41_flash_desc, "tiny": tiny_v41_desc}


def _desc(args: argparse.Namespace) -> ModelCacheDesc:
    return _DESCS[args.model](num_speculative_tokens=args.num_speculative_tokens)


def _group_names(config: KVCacheConfig) -> list[str]:
    names = []
    for group in config.kv_cache_groups:
        first = iter_layer_specs(group.kv_cache_spec)[0]
        kind = type(first).__name__.removesuffix("Spec")
        names.append(f"{kind}[{len(group.layer_names)}]")
    return names


def _layout(args: argparse.Namespace) -> int:
    config = for_model(_desc(args), available_memory_bytes=int(args.memory_gib * 2**30))
    print(
        memory_report(config, args.max_model_len, args.max_num_batched_tokens, packed_layout=True)
    )
    return 0


def _run_turn(
    mgr: KVCacheManager,
    req: Request,
    num_output_tokens: int,
    chunk_tokens: int,
    rng: random.Random,
    lookahead: int,
) -> int:
    """Prefill ``req`` in chunks, decode ``num_output_tokens`` tokens, return the hit tokens."""
    hits, num_hits = mgr.get_computed_blocks(req)
    # Under bounded replay a hit keeps its blocks but its last `replay` tokens run again.
    replay = mgr.num_replay_tokens(num_hits)
    n = min(chunk_tokens, req.num_tokens - (num_hits - replay))
    if mgr.allocate_slots(req, max(n - replay, 0), num_hits, hits) is None:
        raise RuntimeError("the demo pool is too small for one conversation")
    req.num_computed_tokens = num_hits - replay + n
    while req.num_computed_tokens < req.num_tokens:
        n = min(chunk_tokens, req.num_tokens - req.num_computed_tokens)
        if mgr.allocate_slots(req, n) is None:
            raise RuntimeError("the demo pool is too small for one conversation")
        req.num_computed_tokens += n
    for _ in range(num_output_tokens):
        req.append_output_token_ids(rng.randrange(1000, 50_000))
        if mgr.allocate_slots(req, 1, num_lookahead_tokens=lookahead) is None:
            raise RuntimeError("the demo pool is too small for one conversation")
        req.num_computed_tokens += 1
    return num_hits


def _demo(args: argparse.Namespace) -> int:
    desc = _desc(args)
    config = for_model(desc, num_gpu_blocks_override=args.num_blocks)
    mgr = KVCacheManager(
        config,
        args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        swa_bounded_replay=args.bounded_replay,
        use_eagle=args.num_speculative_tokens > 0,
    )
    names = _group_names(config)
    print(
        f"DeepSeek-V4.1 {args.model} cache layout: {len(names)} KV-cache groups {names}; "
        f"{config.num_blocks} blocks; scheduler block {mgr.scheduler_block_size} tokens, "
        f"hash block {mgr.hash_block_size} tokens"
        + (", SWA bounded replay" if args.bounded_replay else "")
    )
    rng = random.Random(args.seed)
    system = [rng.randrange(1000, 50_000) for _ in range(args.system_tokens)]
    total_prompt = total_hits = 0
    for conv in range(args.conversations):
        history = list(system)
        for turn in range(args.turns):
            history += [rng.randrange(1000, 50_000) for _ in range(rng.randint(40, 400))]
            req = mgr.new_request(f"c{conv}t{turn}", history)
            hits = _run_turn(
                mgr, req, rng.randint(16, 200), args.chunk_tokens, rng, args.num_speculative_tokens
            )
            held = [sum(not b.is_null for b in g) for g in mgr.get_blocks(req.request_id).blocks]
            print(
                f"conversation {conv} turn {turn}: prompt {req.num_prompt_tokens:5d} tokens, "
                f"hit {hits:5d} ({hits / req.num_prompt_tokens:4.0%}), "
                f"output {req.num_output_tokens:3d}; blocks held per group {held}; "
                f"pool usage {mgr.usage:.1%}"
            )
            total_prompt += req.num_prompt_tokens
            total_hits += hits
            history = list(req.all_token_ids)
            mgr.free(req)
    print(
        f"prefix-cache hit rate over {args.conversations * args.turns} turns: "
        f"{total_hits / total_prompt:.1%} of {total_prompt} prompt tokens"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsv4", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--model", choices=sorted(_DESCS), default="flash")
    common.add_argument("--max-model-len", type=int, default=65_536)
    common.add_argument("--max-num-batched-tokens", type=int, default=2048)
    common.add_argument("--num-speculative-tokens", type=int, default=0)

    demo = sub.add_parser("demo", parents=[common], help="multi-turn chats through the allocator")
    demo.add_argument("--conversations", type=int, default=3)
    demo.add_argument("--turns", type=int, default=3)
    demo.add_argument("--system-tokens", type=int, default=1500)
    demo.add_argument("--chunk-tokens", type=int, default=2048)
    demo.add_argument("--num-blocks", type=int, default=4096)
    demo.add_argument("--bounded-replay", action="store_true", help="V4.1 SWA bounded replay")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_demo)

    layout = sub.add_parser(
        "layout", parents=[common], help="print the cache layout and its memory"
    )
    layout.add_argument("--memory-gib", type=float, default=16.0)
    layout.set_defaults(func=_layout)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

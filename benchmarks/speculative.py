"""Speculative decoding (fp32, CPU by default): tokens/s with and without it, n-gram drafts on
``tiny_v41`` and the DSpark drafter of the shipped ``tiny_v41_trained``.

Prints one JSON line, measured side by side, with acceptance figures and a check that every
output equals the plain one. Usage and fields: docs/benchmarks.md#benchmarksspeculative.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from benchmarks import at_least_one, batch_sizes


class OracleProposer:
    """Proposes the true continuation of each prompt (from a plain run's outputs)."""

    def __init__(self, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]], k: int):
        self.known = sorted(
            ((list(p), list(o)) for p, o in zip(prompts, outputs)), key=lambda x: -len(x[0])
        )
        self.k = k

    def propose(self, tokens: Sequence[int], num_tokens: int | None = None) -> list[int]:
        tokens = list(tokens)
        n = self.k if num_tokens is None else num_tokens
        for prompt, out in self.known:
            done = len(tokens) - len(prompt)
            ok = 0 <= done <= len(out) and tokens[: len(prompt)] == prompt
            if ok and tokens[len(prompt) :] == out[:done]:
                return out[done : done + n]
        return []


def _prompts(rng, vocab: int, batch: int, length: int) -> list[list[int]]:
    out = []
    for _ in range(batch):
        phrases = [rng.integers(3, vocab, int(rng.integers(2, 5))).tolist() for _ in range(3)]
        seq: list[int] = []
        while len(seq) < length:
            seq += phrases[int(rng.integers(0, 3))]
        out.append(seq[:length])
    return out


def _run(llm, prompts, sp) -> tuple[float, list[list[int]], dict[str, Any]]:
    before = llm.engine.stats.as_dict()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    after = llm.engine.stats.as_dict()
    delta = {
        k: after[k] - before[k]
        for k in (
            "num_steps",
            "spec_num_drafts",
            "spec_num_draft_tokens",
            "spec_num_accepted_tokens",
        )
    }
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return sum(map(len, tokens)) / wall, tokens, delta


def heldout_prefixes(tokenizer, prefix_len: int, num: int) -> list[list[int]]:
    """``num`` held-out prefixes of ``prefix_len`` tokens, the ones `training.dspark.acceptance`
    takes (consecutive windows of the held-out stream, evenly spread)."""
    import numpy as np

    from training import data as D

    split = D.source_split()
    windows = D.consecutive_windows(D.load_split(split, "heldout", tokenizer), prefix_len)
    if len(windows) < num:
        raise ValueError(f"the held-out stream holds {len(windows)} prefixes, fewer than {num}")
    picked = windows[np.linspace(0, len(windows) - 1, num).astype(int)]
    return [row.tolist() for row in picked]


def first_block_acceptance(llm, prefixes: Sequence[Sequence[int]]) -> float:
    """Mean drafts accepted by the first verification after each prefix (greedy): every request
    stops after two tokens, so it verifies exactly one block."""
    from serving.sampling_params import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    _, _, delta = _run(llm, [list(p) for p in prefixes], sp)
    if delta["spec_num_drafts"] != len(prefixes):
        raise RuntimeError(
            f"{delta['spec_num_drafts']} verifications for {len(prefixes)} prefixes (expected one "
            "each)"
        )
    return delta["spec_num_accepted_tokens"] / delta["spec_num_drafts"]


def _llm_kwargs(max_seqs: int, k: int, max_model_len: int, blocks_per_seq: int) -> dict:
    """The `LLM` arguments every mode of one measurement shares (fp32, no compile cache)."""
    return dict(
        dtype="float32",
        max_model_len=max_model_len,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=max(64, max_seqs * (k + 1)),
        num_gpu_blocks_override=blocks_per_seq * max_seqs,
        compilation_cache_dir=None,
    )


def _best_runs(llms: dict, prompts, sp, repeats: int, plain) -> tuple[dict, dict, bool]:
    """Each mode's best tokens/s over ``repeats`` alternating runs (after one warm-up run),
    the engine counters of that run, and whether every output equalled ``plain``."""
    for llm in llms.values():  # warm: any lazy host setup
        _run(llm, prompts, sp)
    best: dict[str, float] = {}
    stats: dict[str, dict] = {}
    equal = True
    for _ in range(repeats):
        for mode, llm in llms.items():
            rate, tokens, delta = _run(llm, prompts, sp)
            equal &= tokens == plain
            if rate > best.get(mode, 0.0):
                best[mode], stats[mode] = rate, delta
    return best, stats, bool(equal)


def _speed_columns(row: dict[str, Any], best: dict, stats: dict) -> None:
    for mode in best:
        row[f"{mode}_tokens_per_s"] = round(best[mode], 1)
        row[f"{mode}_steps"] = stats[mode]["num_steps"]


def _acceptance_columns(row: dict[str, Any], mode: str, s: dict, no_drafts: float) -> None:
    """Accepted over drafted tokens, and 1 + accepted per draft (``no_drafts`` without any)."""
    drafted, drafts = s["spec_num_draft_tokens"], s["spec_num_drafts"]
    accepted = s["spec_num_accepted_tokens"]
    row[f"{mode}_acceptance_rate"] = round(accepted / drafted, 4) if drafted else 0.0
    row[f"{mode}_mean_acceptance_length"] = round(1 + accepted / drafts, 3) if drafts else no_drafts


def measure_dspark(
    batches: Sequence[int],
    k: int,
    prompt_len: int,
    new_tokens: int,
    repeats: int,
    num_prefixes: int,
) -> dict[str, Any]:
    """The DSpark rows of the module docstring."""
    from serving.llm import LLM
    from serving.sampling_params import SamplingParams

    max_model_len = max(prompt_len + new_tokens, 128 + 2) + k + 8
    common = _llm_kwargs(max(batches), k, max_model_len, blocks_per_seq=96)
    spec = {"method": "dspark", "num_speculative_tokens": k}
    model = "tiny_v41_trained"
    llms = {
        "trained_plain_sync": LLM(model, async_scheduling=False, **common),
        "trained_plain_async": LLM(model, async_scheduling=True, **common),
        "dspark": LLM(model, speculative_config=spec, async_scheduling=False, **common),
        "dspark_async": LLM(model, speculative_config=spec, async_scheduling=True, **common),
    }
    tok = llms["dspark"].get_tokenizer()
    sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    out: dict[str, Any] = {"model": model, "k": k}
    for b in batches:
        prompts = heldout_prefixes(tok, prompt_len, b)
        _, plain, _ = _run(llms["trained_plain_sync"], prompts, sp)
        best, stats, equal = _best_runs(llms, prompts, sp, repeats, plain)
        row: dict[str, Any] = {"outputs_equal": equal}
        _speed_columns(row, best, stats)
        for mode in ("dspark", "dspark_async"):
            for base in ("plain_sync", "plain_async"):
                row[f"{mode}_over_{base}"] = round(best[mode] / best[f"trained_{base}"], 3)
            _acceptance_columns(row, mode, stats[mode], no_drafts=1.0)
        out[f"batch_{b}"] = row
    per_pos = llms["dspark"].engine.stats.spec_acceptance_per_pos
    out["dspark_acceptance_per_pos"] = [round(x, 4) for x in per_pos]
    if num_prefixes:
        out["first_block"] = _first_block(llms["dspark"], tok, num_prefixes)
    return out


def _first_block(llm, tok, num_prefixes: int) -> dict[str, Any]:
    """The drafter's first-block acceptance on held-out prefixes: in the engine and offline."""
    import numpy as np

    from training import dspark as train_dspark

    prefixes = heldout_prefixes(tok, 128, num_prefixes)
    engine = first_block_acceptance(llm, prefixes)
    cfg, params = llm.cfg, llm.engine.runner.params
    heldout = [t for p in prefixes for t in p]  # the same prefixes, back to back
    offline = train_dspark.acceptance(
        params, cfg, np.asarray(heldout), prefix_len=128, num_prefixes=num_prefixes
    )
    return {
        "prefixes": num_prefixes,
        "engine_mean_accepted": round(engine, 4),
        "offline_mean_accepted": round(offline["mean_acceptance_length"], 4),
        "offline_per_position": [round(x, 4) for x in offline["per_position_acceptance"]],
    }


def measure(
    batches: Sequence[int],
    k: int,
    prompt_len: int,
    new_tokens: int,
    repeats: int,
    model: str = "tiny_v41",
):
    """The n-gram rows of the module docstring (and an oracle proposer's, its ceiling)."""
    import jax
    import numpy as np

    from serving.llm import LLM
    from serving.sampling_params import SamplingParams

    common = _llm_kwargs(max(batches), k, prompt_len + new_tokens + k + 8, blocks_per_seq=64)
    spec = {
        "method": "ngram",
        "num_speculative_tokens": k,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
    }
    llms = {
        "plain_sync": LLM(model, async_scheduling=False, **common),
        "plain_async": LLM(model, async_scheduling=True, **common),
        "ngram": LLM(model, speculative_config=spec, async_scheduling=False, **common),
        "ngram_async": LLM(model, speculative_config=spec, async_scheduling=True, **common),
        "oracle": LLM(model, speculative_config=spec, async_scheduling=False, **common),
    }
    ngram_proposer = llms["oracle"].engine.proposer
    rng = np.random.default_rng(0)
    sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    results = {}
    for b in batches:
        prompts = _prompts(rng, llms["ngram"].cfg.vocab_size, b, prompt_len)
        llms["oracle"].engine.proposer = ngram_proposer
        _, plain, _ = _run(llms["plain_sync"], prompts, sp)
        llms["oracle"].engine.proposer = OracleProposer(prompts, plain, k)
        best, stats, equal = _best_runs(llms, prompts, sp, repeats, plain)
        row: dict[str, Any] = {"batch": b, "outputs_equal": equal}
        _speed_columns(row, best, stats)
        for mode in ("ngram", "ngram_async", "oracle"):
            _acceptance_columns(row, mode, stats[mode], no_drafts=0.0)
            for base in ("plain_sync", "plain_async"):
                row[f"{mode}_over_{base}"] = round(best[mode] / best[base], 3)
        per_pos = llms["ngram"].engine.stats.spec_acceptance_per_pos
        row["ngram_acceptance_per_pos"] = [round(x, 4) for x in per_pos]
        results[f"batch_{b}"] = row
    return {
        "backend": jax.default_backend(),
        "model": model,
        "k": k,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "results": results,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,8", help="comma list of batch sizes")
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    p.add_argument("--prompt-len", type=int, default=48)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--no-ngram", action="store_true", help="skip the n-gram rows")
    p.add_argument(
        "--ngram-model",
        choices=("tiny_v41", "tiny_v41_trained"),
        default="tiny_v41",
        help="the model of the n-gram rows (the trained one continues repeated phrases)",
    )
    p.add_argument(
        "--dspark-k",
        type=int,
        default=5,
        help="DSpark drafts per step on tiny_v41_trained (0: skip)",
    )
    p.add_argument(
        "--prefixes",
        type=int,
        default=64,
        help="held-out prefixes of the first-block figure (0: skip)",
    )
    args = p.parse_args(argv)
    batches = batch_sizes(p, args.batches)
    at_least_one(p, args, "k", "prompt_len", "new_tokens", "repeats")
    if not 0 <= args.dspark_k <= 5:
        p.error(f"--dspark-k must be in 0..5 (the shipped drafter's block), got {args.dspark_k}")
    if args.prefixes < 0:
        p.error(f"--prefixes must be >= 0, got {args.prefixes}")
    t0 = time.perf_counter()
    out: dict[str, Any] = {"benchmark": "speculative"}
    if not args.no_ngram:
        out.update(
            measure(
                batches, args.k, args.prompt_len, args.new_tokens, args.repeats, args.ngram_model
            )
        )
    if args.dspark_k:
        out["dspark"] = measure_dspark(
            batches, args.dspark_k, args.prompt_len, args.new_tokens, args.repeats, args.prefixes
        )
    out["wall_s"] = round(time.perf_counter() - t0, 2)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

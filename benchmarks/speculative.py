"""Speculative decoding on ``tiny_v41`` (fp32, CPU by default): tokens/s with and without it.

    python -m benchmarks.speculative                    # batches 1, 8; k = 3; 64 new tokens
    python -m benchmarks.speculative --batches 1 --k 5 --repeats 3

Prints ONE JSON line. For each batch size B, B prompts made of a few repeated phrases (a
repetitive workload: n-gram lookup finds matches in them), greedy, no EOS; measured side by side
in one process, interleaved, best of ``--repeats`` warm runs each:

* ``plain_sync_tokens_per_s`` / ``plain_async_tokens_per_s``: `LLM.generate` without drafts;
* ``ngram_tokens_per_s``: with ``{"method": "ngram", "num_speculative_tokens": k}`` (lookup
  lengths 1..3), and its ``acceptance_rate``, ``mean_acceptance_length`` and per-position
  acceptance;
* ``oracle_tokens_per_s``: the same engine with a drafter that proposes the true continuation
  (known from the plain run), every draft accepted: the ceiling of the verification step at
  this k, not a method one could serve with;
* ``ngram_over_plain_sync`` etc.: the ratios. Every speculative output is checked equal to the
  plain one (``outputs_equal``).

The random tiny weights almost never continue a phrase of the prompt, so n-gram drafts are
nearly all rejected here and speculation costs time; the trained small model (issue 12) is
where n-gram and DSpark acceptance become meaningful. The oracle row shows what the engine
gains per accepted draft.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from benchmarks import batch_sizes


class OracleProposer:
    """Proposes the true continuation of each prompt (from a plain run's outputs)."""

    def __init__(self, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]], k: int):
        self.known = sorted(
            ((list(p), list(o)) for p, o in zip(prompts, outputs)), key=lambda x: -len(x[0])
        )
        self.k = k

    def propose(self, tokens: Sequence[int]) -> list[int]:
        tokens = list(tokens)
        for prompt, out in self.known:
            done = len(tokens) - len(prompt)
            ok = 0 <= done <= len(out) and tokens[: len(prompt)] == prompt
            if ok and tokens[len(prompt) :] == out[:done]:
                return out[done : done + self.k]
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


def measure(batches: Sequence[int], k: int, prompt_len: int, new_tokens: int, repeats: int):
    import jax
    import numpy as np

    from serving.llm import LLM
    from serving.sampling_params import SamplingParams

    max_seqs = max(batches)
    budget = max(64, max_seqs * (k + 1))
    common = dict(
        dtype="float32",
        max_model_len=prompt_len + new_tokens + k + 8,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=budget,
        num_gpu_blocks_override=64 * max_seqs,
        compilation_cache_dir=None,
    )
    spec = {
        "method": "ngram",
        "num_speculative_tokens": k,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
    }
    llms = {
        "plain_sync": LLM("tiny_v41", async_scheduling=False, **common),
        "plain_async": LLM("tiny_v41", async_scheduling=True, **common),
        "ngram": LLM("tiny_v41", speculative_config=spec, **common),
        "oracle": LLM("tiny_v41", speculative_config=spec, **common),
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
        row: dict[str, Any] = {"batch": b, "outputs_equal": bool(equal)}
        for mode in llms:
            row[f"{mode}_tokens_per_s"] = round(best[mode], 1)
            row[f"{mode}_steps"] = stats[mode]["num_steps"]
        for mode in ("ngram", "oracle"):
            s = stats[mode]
            row[f"{mode}_acceptance_rate"] = (
                round(s["spec_num_accepted_tokens"] / s["spec_num_draft_tokens"], 4)
                if s["spec_num_draft_tokens"]
                else 0.0
            )
            row[f"{mode}_mean_acceptance_length"] = (
                round(1 + s["spec_num_accepted_tokens"] / s["spec_num_drafts"], 3)
                if s["spec_num_drafts"]
                else 0.0
            )
            for base in ("plain_sync", "plain_async"):
                row[f"{mode}_over_{base}"] = round(best[mode] / best[base], 3)
        per_pos = llms["ngram"].engine.stats.spec_acceptance_per_pos
        row["ngram_acceptance_per_pos"] = [round(x, 4) for x in per_pos]
        results[f"batch_{b}"] = row
    return {
        "backend": jax.default_backend(),
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
    args = p.parse_args(argv)
    batches = batch_sizes(p, args.batches)
    for flag, value in (
        ("--k", args.k),
        ("--prompt-len", args.prompt_len),
        ("--new-tokens", args.new_tokens),
        ("--repeats", args.repeats),
    ):
        if value < 1:
            p.error(f"{flag} must be >= 1, got {value}")
    t0 = time.perf_counter()
    out = {
        "benchmark": "speculative",
        **measure(batches, args.k, args.prompt_len, args.new_tokens, args.repeats),
    }
    out["wall_s"] = round(time.perf_counter() - t0, 2)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

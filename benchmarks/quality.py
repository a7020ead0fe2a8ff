"""Quality of the shipped small model (`tiny_v41_trained`, issue 12): held-out bits per byte next
to ``xz -9``, and what each cache layout costs in bits per byte.

    python -m benchmarks.quality            # the whole table (about 10 minutes on 2 CPU cores)
    python -m benchmarks.quality --quick    # fewer pieces and rows, for a smoke run
    python -m benchmarks.quality --table    # the README's markdown table (the whole run)

Prints ONE JSON line (``--table``: a markdown table instead).

* ``heldout``: the model's bits per byte over all of the held-out files of `dsv4.data` (the
  files the model never saw), scored in consecutive windows of 1024 tokens as it was trained (its
  longest) and of 256 (`dsv4.train.evaluate`), next to ``xz -9e`` on the same bytes, once as
  one stream and once file by file. Bits per token become bits per byte through the stream's
  tokens per byte.
* ``rows``: `serving.lab.quality.score_layout`, the paged engine (fp32 params) scoring
  held-out pieces with ``prompt_logprobs``, one row per cache layout: the record preset of the cache
  (``dsv4.paged.records``: exact f32, bf16, the released fp8 / FP4 records, sm90), SWA bounded
  replay off or on, and the indexer's top-k (the model was trained with 16). Each piece is
  ``--prefix`` tokens then ``--tail`` tokens; ``cold_bits_per_byte`` scores the tail with no
  prefix hit, ``hit_bits_per_byte`` scores it after the prefix was cached by an earlier request
  (the engine's ``prompt_logprobs_on_hits``), where bounded replay rebuilds the window of the
  hit from truncated windows: the only place it can cost anything. Bytes per token are the
  byte-level BPE's own (one alphabet character per byte).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from serving.lab import quality as Q


def _args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--pieces", type=int, default=16, help="held-out pieces per row")
    p.add_argument("--prefix", type=int, default=256, help="tokens of a piece before its tail")
    p.add_argument("--tail", type=int, default=128, help="scored tokens of a piece")
    p.add_argument("--topk", default="16,8,4", help="index top-k values (rows at exact, no replay)")
    p.add_argument("--quick", action="store_true", help="4 pieces; exact and released; top-k 16, 8")
    p.add_argument("--no-heldout", action="store_true", help="skip the whole-held-out score")
    p.add_argument("--table", action="store_true", help="print the README's markdown table")
    p.add_argument("--save", default=None, help="also write the JSON result to this file")
    a = p.parse_args(argv)
    a.topk = [int(v) for v in a.topk.split(",")]
    if a.quick:
        a.pieces, a.topk = 4, [16, 8]
    for flag in ("pieces", "prefix", "tail"):
        if getattr(a, flag) < 1:
            p.error(f"--{flag} {getattr(a, flag)}: must be >= 1")
    if any(k < 1 for k in a.topk):
        p.error(f"--topk {a.topk}: every value must be >= 1")
    return a


def run(a: argparse.Namespace) -> dict[str, Any]:
    import jax

    from dsv4.checkpoint import load_pretrained, shipped_checkpoint
    from dsv4.tokenizer import load_tokenizer

    jax.config.update("jax_default_matmul_precision", "highest")
    path = shipped_checkpoint("tiny_v41_trained")
    cfg, params = load_pretrained(path, progress=False)
    tok = load_tokenizer(path, cfg)
    out: dict[str, Any] = {"model": "tiny_v41_trained", "backend": jax.default_backend()}
    if not a.no_heldout:
        out["heldout"] = Q.heldout_score(params, cfg, tok)
    docs = Q.heldout_pieces(tok, a.pieces, a.prefix + a.tail)
    nbytes = Q.token_bytes(tok)
    presets = ("exact", "released") if a.quick else Q.RECORD_PRESETS
    out["skipped"] = {p: why for p in presets if (why := Q.records_fit(p, cfg)) is not None}
    presets = [p for p in presets if p not in out["skipped"]]
    plan = [(p, r, a.topk[0]) for p in presets for r in (False, True)]
    plan += [("exact", False, k) for k in a.topk[1:]]
    out["pieces"], out["prefix"], out["tail"] = a.pieces, a.prefix, a.tail
    out["rows"] = [
        Q.score_layout(
            params,
            cfg,
            tok,
            docs,
            records=p,
            bounded_replay=r,
            index_topk=k,
            prefix=a.prefix,
            nbytes=nbytes,
        )
        for p, r, k in plan
    ]
    return out


def table(result: dict[str, Any]) -> str:
    h = result.get("heldout")
    lines = []
    if h:
        model = ", ".join(
            f"**{v:.3f}** in windows of {n} tokens" for n, v in h["model_bits_per_byte"].items()
        )
        lines += [
            f"Held-out text ({h['files']} files, {h['bytes']:,} bytes), bits per byte: the model "
            f"{model}; `xz -9e` {h['xz_one_stream_bits_per_byte']:.3f} as one stream, "
            f"{h['xz_per_file_bits_per_byte']:.3f} file by file.",
            "",
        ]
    lines += [
        f"Tails of {result['tail']} tokens after {result['prefix']} ({result['pieces']} held-out "
        "pieces), bits per byte:",
        "",
        "| records | bounded replay | index top-k | cold | after a prefix hit | tokens hit |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['records']} | {'on' if r['bounded_replay'] else 'off'} | {r['index_topk']} "
            f"| {r['cold_bits_per_byte']:.4f} | {r['hit_bits_per_byte']:.4f} "
            f"| {r['mean_hit_tokens']:.0f} |"
        )
    for name, why in result.get("skipped", {}).items():
        lines.append(f"| {name} | | | not for this model: {why} | | |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    a = _args(argv)
    result = run(a)
    if a.save:
        with open(a.save, "w", encoding="utf-8") as f:
            json.dump(result, f)
    print(table(result) if a.table else json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

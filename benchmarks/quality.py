"""Quality of the shipped small model (`tiny_v41_trained`, issue 12): held-out bits per byte next
to ``xz -9``, and what each cache layout costs in bits per byte.

Prints one JSON line (``--table``: README.md's figures table; ``--quick``: a smoke run; the whole
run takes about 10 minutes on 2 CPU cores). Fields: docs/benchmarks.md#benchmarksquality.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from benchmarks import at_least_one
from lab import quality as Q


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
    at_least_one(p, a, "pieces", "prefix", "tail")
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

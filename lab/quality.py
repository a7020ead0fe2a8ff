"""What a cache layout costs in quality: bits per byte of a trained model (the shipped
`tiny_v41_trained`, `dsv4.checkpoint.shipped_checkpoint`) on held-out text, through the paged
engine, for a record preset, bounded replay on or off, and an index top-k.

Tails are scored cold and after a prefix hit; JAX is imported only by the functions that run the
model. Details: docs/lab.md#labquality.
"""

from __future__ import annotations

import dataclasses
import lzma
import math
from collections.abc import Sequence
from typing import Any

from dsv4.paged import records as R
from serving.config import EngineConfig
from serving.engine import Engine
from serving.sampling_params import SamplingParams
from training import data as D
from training import train as T

__all__ = [
    "RECORD_PRESETS",
    "heldout_pieces",
    "heldout_score",
    "records_fit",
    "score_layout",
    "token_bytes",
]

# dsv4.paged.records.PRESETS by the lower-case names LLM's kv_cache_dtype uses
RECORD_PRESETS = ("exact", "bf16", "released", "released_fp8", "sm90")


def _formats(records: str):

    if records not in RECORD_PRESETS:
        raise ValueError(f"records={records!r}: one of {', '.join(RECORD_PRESETS)}")
    return R.PRESETS[records.upper()]


def records_fit(records: str, cfg) -> str | None:
    """None when the preset ``records`` can store ``cfg``'s cache rows, else why not (the
    released and SM90 records are laid out for the released head dims)."""
    formats = _formats(records)  # an unknown name is an error, not a misfit
    try:
        formats.check_dims(cfg.head_dim, cfg.index_head_dim)
    except ValueError as exc:
        return str(exc)
    return None


def token_bytes(tokenizer) -> list[int]:
    """Bytes each id of a byte-level BPE (`dsv4.tokenizer.HFTokenizer`) stands for: it spells
    every byte as one character of its alphabet; special tokens stand for none."""
    inner = tokenizer._tok
    special = {t.content for t in inner.get_added_tokens_decoder().values()}
    out = []
    for i in range(tokenizer.vocab_size):
        s = inner.id_to_token(i)
        out.append(0 if s is None or s in special else len(s))
    return out


def heldout_pieces(tokenizer, n: int, length: int) -> list[list[int]]:
    """``n`` non-overlapping pieces of ``length`` tokens spread evenly over the held-out stream
    of `training.data` (files the shipped model never saw)."""

    if n < 1 or length < 2:
        raise ValueError(f"n={n} must be >= 1 and length={length} >= 2")
    split = D.source_split()
    stream = D.load_split(split, "heldout", tokenizer)
    stride = len(stream) // n
    if stride < length:
        raise ValueError(f"{n} pieces of {length} tokens do not fit in {len(stream)} tokens")
    return [stream[i * stride : i * stride + length].astype(int).tolist() for i in range(n)]


def heldout_score(
    params, cfg, tokenizer, *, seq_lens: Sequence[int] = (256, 1024), root: str | None = None
) -> dict[str, Any]:
    """Bits per byte over every held-out file, scored in consecutive windows of each of
    ``seq_lens`` tokens (`training.train.evaluate`; the shipped model was trained on windows of
    1024, its longest), next to ``xz -9e`` on the same bytes (as one stream, and file by file).
    ``root``: the source tree (default: the running interpreter's standard library,
    `training.data.stdlib_root`)."""

    split = D.source_split(root)
    tokens = D.load_split(split, "heldout", tokenizer)
    files = D.read_split(split, "heldout", utf8_only=True)
    size = sum(map(len, files))
    by_context = {}
    for n in seq_lens:
        nats = T.evaluate(params, cfg, tokens, seq_len=n, batch_size=8, batches=1 << 30)
        by_context[n] = nats / math.log(2) * len(tokens) / size
    preset = 9 | lzma.PRESET_EXTREME
    per_file = sum(len(lzma.compress(f, preset=preset)) for f in files)
    return {
        "files": len(files),
        "bytes": size,
        "tokens": len(tokens),
        "model_bits_per_byte": by_context,  # context length -> bits per byte
        "xz_one_stream_bits_per_byte": 8
        * len(lzma.compress(b"".join(files), preset=preset))
        / size,
        "xz_per_file_bits_per_byte": 8 * per_file / size,
    }


def score_layout(
    params,
    cfg,
    tokenizer,
    docs: Sequence[Sequence[int]],
    *,
    records: str = "exact",
    bounded_replay: bool = False,
    index_topk: int | None = None,
    prefix: int,
    nbytes: Sequence[int] | None = None,
    max_num_batched_tokens: int = 128,
) -> dict[str, Any]:
    """One cache layout: the bits per byte of every piece's tail (positions ``prefix`` on),
    cold and after a hit on the cached prefix (module docstring). ``docs`` are pieces of one
    length (`heldout_pieces`); ``index_topk`` overrides the config's (None: keep it)."""

    _formats(records)  # an unknown name is refused with the records it may be
    length = len(docs[0])
    if not docs or any(len(d) != length for d in docs) or not 0 < prefix < length:
        raise ValueError(f"pieces of one length above prefix={prefix} are needed")
    nbytes = token_bytes(tokenizer) if nbytes is None else nbytes
    row_cfg = cfg if index_topk is None else dataclasses.replace(cfg, index_topk=index_topk)
    config = EngineConfig.from_kwargs(
        kv_cache_dtype=records,
        max_model_len=length + 8,
        max_num_seqs=4,
        max_num_batched_tokens=max_num_batched_tokens,
        num_gpu_blocks_override=4 * len(docs) * (length // 4 + 8),
        swa_bounded_replay=bounded_replay,
        token_buckets=(16, max_num_batched_tokens),
        async_scheduling=False,
        prompt_logprobs_on_hits=True,
    )
    engine = Engine.build(params, row_cfg, config, tokenizer=tokenizer)
    engine.warm_up(progress=False)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    score = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    _run(engine, [d[:prefix] for d in docs], one, "prefix")  # caches each prefix
    hit_outs = _run(engine, docs, score, "hit")
    hit_bpb, hit_scored = _bits(docs, hit_outs, prefix, nbytes)
    engine.prompt_logprobs_on_hits = False  # vLLM's rule: no cache read, every position computed
    cold_bpb, cold_scored = _bits(docs, _run(engine, docs, score, "cold"), prefix, nbytes)
    return {
        "records": records,
        "bounded_replay": bounded_replay,
        "index_topk": row_cfg.index_topk,
        "cold_bits_per_byte": cold_bpb,
        "hit_bits_per_byte": hit_bpb,
        "mean_hit_tokens": sum(o.num_cached_tokens for o in hit_outs) / len(hit_outs),
        "scored_tokens": {"cold": cold_scored, "hit": hit_scored},
    }


def _run(engine: Engine, prompts, sp: SamplingParams, tag: str) -> list:
    """Run ``prompts`` through ``engine`` to the end; their finished outputs in order."""
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}{i}", p, sp)
    done = {}
    with engine.serving_loop():
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
    return [done[f"{tag}{i}"] for i in range(len(prompts))]


def _bits(docs, outs, prefix: int, nbytes: Sequence[int]) -> tuple[float, int]:
    """(bits per byte, positions scored) of the tails the requests computed themselves."""
    total_bits, total_bytes, scored = 0.0, 0, 0
    for doc, out in zip(docs, outs):
        for pos in range(prefix, len(doc)):
            entry = out.prompt_logprobs[pos]
            if entry is None:  # served from the cache, not computed by this request
                continue
            total_bits -= entry[doc[pos]].logprob / math.log(2)
            total_bytes += nbytes[doc[pos]]
            scored += 1
    return total_bits / max(total_bytes, 1), scored

"""Cost model of sparse attention: HBM bytes and FLOPs of one call, as the kernels move them.

Used for `pl.CostEstimate` (static shapes: every top-k slot counted as selected) and by
benchmarks/kernels.py for the roofline.
"""

from __future__ import annotations

from pallas_kernels.backend import Cost, call_sizes


def sparse_cost(
    *,
    num_tokens: int,
    heads: int,
    dim: int,
    topk: int,
    q_bytes: int,
    kv_bytes: int,
    with_state: bool,
    distinct_rows: int | None = None,
) -> Cost:
    """Bytes and FLOPs of one sparse-attention call.

    Rows: `distinct_rows` entries fetched (default `num_tokens * topk`: nothing shared; tokens of
    one request fetching their union once lower it). Each selected row is read once from the paged
    cache straight into on-chip memory: no gathered copy is written back to HBM. The window state,
    when given, is read in f32.
    """
    rows = num_tokens * topk if distinct_rows is None else distinct_rows
    q = num_tokens * heads * dim * q_bytes
    state = num_tokens * heads * (dim + 2) * 4 if with_state else 0
    meta = num_tokens * topk * 4 * 2  # top-k ids and the row addresses derived from them
    keys = num_tokens * heads * topk
    return Cost(
        bytes_accessed=2 * q + state + rows * dim * kv_bytes + meta,
        flops=4 * keys * dim,
        transcendentals=keys,
    )


def sparse_call_cost(q, comp_pages, k: int, with_state: bool) -> Cost:
    """`sparse_cost` of one kernel call on ``q`` [T, H, D] and ``comp_pages``, ``k`` picks each."""
    return sparse_cost(**call_sizes(q, comp_pages), topk=k, with_state=with_state)

"""Cost model of window attention: HBM bytes and FLOPs of one call, as the kernels move them.

Used for `pl.CostEstimate` (static shapes only, so it assumes full windows) and by
benchmarks/kernels.py for the roofline.
"""

from __future__ import annotations

from pallas_kernels.backend import Cost, call_sizes, cdiv, window_pages


def window_cost(
    *,
    num_tokens: int,
    num_requests: int,
    heads: int,
    dim: int,
    window: int,
    page_size: int,
    q_bytes: int,
    kv_bytes: int,
    out_bytes_total: int | None = None,
    tokens_per_tile: int = 8,
) -> Cost:
    """Bytes and FLOPs of one window-attention call over `num_tokens` tokens.

    Page traffic: a decode-like batch (at most one token per request) fetches each token's whole
    window (`window_pages` pages); otherwise tokens are assumed grouped by request in tiles of
    `tokens_per_tile`, each tile fetching its union of pages once. Output: `out_bytes_total`
    (the state is f32 and larger than `out`), default q-sized.
    """
    page_bytes = page_size * dim * kv_bytes
    nw = window_pages(window, page_size)
    if num_tokens <= num_requests:
        kv = num_tokens * nw * page_bytes
    else:
        tiles = cdiv(num_tokens, tokens_per_tile)
        kv = tiles * (cdiv(tokens_per_tile + window - 2, page_size) + 1) * page_bytes
    q = num_tokens * heads * dim * q_bytes
    out = q if out_bytes_total is None else out_bytes_total
    meta = num_tokens * (3 + nw) * 4
    keys = num_tokens * heads * window
    return Cost(bytes_accessed=q + out + kv + meta, flops=4 * keys * dim, transcendentals=keys)


def window_call_cost(q, swa_pages, window: int, num_requests: int, out_bytes_total: int) -> Cost:
    """`window_cost` of one kernel call on ``q`` [T, H, D] and ``swa_pages`` [P, S, D]."""
    return window_cost(
        **call_sizes(q, swa_pages),
        num_requests=num_requests,
        window=window,
        page_size=swa_pages.shape[1],
        out_bytes_total=out_bytes_total,
    )

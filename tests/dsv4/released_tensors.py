"""The released V4.1-Flash checkpoint's per-block tensors, written out by hand.

Names, stored dtypes and shapes as the released checkpoint holds them (docs/model.md,
"Checkpoint format"), not derived from ``dsv4.params``: fp8 scales per 32 x 32 tile, the routed experts' fp4
values packed two to an int8 with a scale per 32 values of a row. A backbone layer and a DSpark
drafter stage share this block; they differ in their number of routed experts.
"""

from __future__ import annotations

F8, E8M0, I8, BF16, F32 = "F8_E4M3", "F8_E8M0", "I8", "BF16", "F32"
Table = dict[str, tuple[str, tuple[int, ...]]]


def block(n_experts: int) -> Table:
    """A block's norms, hyper-connections, attention, router and shared expert (V4.1-Flash: dim
    5120, 64 heads x 512, q rank 1280, 8 x 1024 output groups, shared expert width 2304)."""
    hc = {
        f"hc_{part}_{name}": (F32, shape)
        for part in ("attn", "ffn")
        for name, shape in (("fn", (24, 20480)), ("base", (24,)), ("scale", (3,)))
    }
    shared = "ffn.shared_experts."
    return {
        "attn_norm.weight": (BF16, (5120,)),
        "ffn_norm.weight": (BF16, (5120,)),
        **hc,
        "attn.wq_a.weight": (F8, (1280, 5120)),
        "attn.wq_a.scale": (E8M0, (40, 160)),
        "attn.q_norm.weight": (BF16, (1280,)),
        "attn.wq_b.weight": (F8, (32768, 1280)),
        "attn.wq_b.scale": (E8M0, (1024, 40)),
        "attn.wkv.weight": (F8, (512, 5120)),
        "attn.wkv.scale": (E8M0, (16, 160)),
        "attn.kv_norm.weight": (BF16, (512,)),
        "attn.wo_a.weight": (F8, (8192, 4096)),
        "attn.wo_a.scale": (E8M0, (256, 128)),
        "attn.wo_b.weight": (F8, (5120, 8192)),
        "attn.wo_b.scale": (E8M0, (160, 256)),
        "attn.attn_sink": (F32, (64,)),
        "ffn.gate.weight": (BF16, (n_experts, 5120)),
        "ffn.gate.bias": (F32, (n_experts,)),
        **{f"{shared}{w}.weight": (F8, (2304, 5120)) for w in ("w1", "w3")},
        **{f"{shared}{w}.scale": (E8M0, (72, 160)) for w in ("w1", "w3")},
        f"{shared}w2.weight": (F8, (5120, 2304)),
        f"{shared}w2.scale": (E8M0, (160, 72)),
    }


# one routed expert (width 2304): fp4 packed in int8, a scale per 32 values of a row
EXPERT: Table = {
    **{f"{w}.weight": (I8, (2304, 2560)) for w in ("w1", "w3")},
    **{f"{w}.scale": (E8M0, (2304, 160)) for w in ("w1", "w3")},
    "w2.weight": (I8, (5120, 1152)),
    "w2.scale": (E8M0, (5120, 72)),
}


def experts(n_experts: int) -> Table:
    """The routed experts' tensors, ``ffn.experts.{e}.*`` for each of ``n_experts``."""
    return {f"ffn.experts.{e}.{k}": v for e in range(n_experts) for k, v in EXPERT.items()}

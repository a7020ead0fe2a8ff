"""Expert parallelism with a real token dispatch (docs/scale_out.md).

Under a mesh whose ``expert`` axis has more than one device, the routed experts of `layers.moe`
run here instead of on every device: the routed experts' weights stay split over ``expert``
(`dsv4.sharding.PARAM_RULES`), the tokens are split over every mesh axis, and inside a
`jax.shard_map` each device

1. sends each of its token's k assignments (the token's row and its routing weight) to the
   expert shard that owns the assignment's expert (`lax.all_to_all` over ``expert``),
2. runs the assignments it received through its own experts as grouped matmuls
   (`lax.ragged_dot` over the received rows sorted by local expert),
3. sends the results back (a second `all_to_all`), and adds each token's k results.

Capacity is exact: a device's send buffer holds, for every destination shard, a slot for every
one of its assignments (the worst case: all of them routed there), so no token is ever dropped
and nothing depends on how routing falls. The buffers are ``expert`` times the assignments;
slots without an assignment carry local expert id ``e_local`` (no group) and come back zero.

The arithmetic per assignment is the one of `layers.moe`'s gather branch, in the same order and
dtypes (gate and up projections accumulated in f32 and cast to the activation dtype, SwiGLU in
f32 times the routing weight, the fp8 QDQ of the intermediate under ``quant_sim``, the down
projection in f32 cast to the activation dtype, the k results added in f32), so the sharded
forward equals the single-device one up to the order of the matmuls' own sums.

The mesh is data: the forward paths take ``mesh=`` (a static argument under `jax.jit`) and hand
it down to `layers.moe`; nothing reads JAX's ambient mesh. Without a mesh, or with an ``expert``
axis of 1, `layers.moe` computes every expert locally and XLA's SPMD partitioner places the work.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from dsv4.config import ModelConfig
from dsv4.quant import fp8_qdq

__all__ = ["expert_mesh", "routed_experts", "swiglu"]

EXPERT = "expert"


def expert_mesh(mesh, cfg: ModelConfig):
    """``mesh`` when it splits the routed experts over an ``expert`` axis of size > 1, else
    None (no mesh, or no such axis: every expert runs locally).

    Raises:
        ValueError: the ``expert`` axis does not divide the routed experts.
    """
    if mesh is None or mesh.empty or EXPERT not in mesh.axis_names or mesh.shape[EXPERT] == 1:
        return None
    if cfg.n_routed_experts % mesh.shape[EXPERT]:
        raise ValueError(
            f"n_routed_experts={cfg.n_routed_experts} is not divisible by the mesh axis "
            f"expert={mesh.shape[EXPERT]}"
        )
    return mesh


def swiglu(gate: jax.Array, up: jax.Array, limit: float) -> jax.Array:
    """An expert's activation, f32: ``silu(gate) * up``, with ``up`` clipped to ``±limit`` and
    ``gate`` capped at ``limit`` when ``limit > 0`` (the one definition; `dsv4.layers` uses it)."""
    gate = gate.astype(jnp.float32)
    up = up.astype(jnp.float32)
    if limit > 0:
        up = jnp.clip(up, -limit, limit)
        gate = jnp.minimum(gate, limit)
    return jax.nn.silu(gate) * up


def routed_experts(
    x: jax.Array,  # [n, dim] activation dtype, already fp8-QDQ'd under quant_sim
    weights: jax.Array,  # f32[n, k] routing weights
    ids: jax.Array,  # i32[n, k] routed expert ids
    w1: jax.Array,  # [e, inter, dim] gate projections (split over expert), x's dtype
    w2: jax.Array,  # [e, dim, inter] down projections, x's dtype
    w3: jax.Array,  # [e, inter, dim] up projections, x's dtype
    cfg: ModelConfig,
    mesh,
    *,
    quant: bool,
) -> jax.Array:
    """sum_j expert_{ids[:, j]}(x) * weights[:, j], f32 [n, dim], with the dispatch described
    in the module docstring over ``mesh`` (from `expert_mesh`). The weights come in
    the activation dtype (`layers.moe` casts them, which also dequantises weights kept in their
    released formats, each device its own experts)."""
    n = x.shape[0]
    shards = mesh.size
    padded = -(-n // shards) * shards  # tokens split evenly over every device
    if padded != n:
        pad = padded - n
        x = jnp.pad(x, ((0, pad), (0, 0)))
        weights = jnp.pad(weights, ((0, pad), (0, 0)))
        ids = jnp.pad(ids, ((0, pad), (0, 0)), constant_values=-1)  # -1: no assignment
    tokens = PartitionSpec(tuple(mesh.axis_names), None)
    experts = PartitionSpec(EXPERT, None, None)
    body = functools.partial(
        _dispatch,
        num_shards=mesh.shape[EXPERT],
        limit=cfg.swiglu_limit,
        block=cfg.fp8_block_size,
        quant=quant,
    )
    y = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(tokens, tokens, tokens, experts, experts, experts),
        out_specs=tokens,
    )(x, weights, ids, w1, w2, w3)
    return y[:n]


def _dispatch(x, weights, ids, w1, w2, w3, *, num_shards, limit, block, quant):
    """One device's part: x [n_l, dim], weights / ids [n_l, k], w* its e_l experts."""
    n_l, k = ids.shape
    dim = x.shape[1]
    e_l = w1.shape[0]
    a = n_l * k  # this device's assignments
    dt = x.dtype
    flat_ids = ids.reshape(a)
    owner = jnp.where(flat_ids >= 0, flat_ids // e_l, -1)  # destination shard, -1 = none
    local = jnp.where(flat_ids >= 0, flat_ids % e_l, e_l)
    to = jnp.arange(num_shards)[:, None] == owner[None, :]  # bool[S, A]: slot (d, j) used
    rows = jnp.repeat(x, k, axis=0)  # [A, dim] assignment j is token j // k
    send_x = jnp.where(to[..., None], rows[None], 0).astype(dt)  # [S, A, dim]
    send_w = jnp.where(to, weights.reshape(a)[None], 0.0)  # f32[S, A]
    send_e = jnp.where(to, local[None], e_l)  # i32[S, A]

    recv_x = jax.lax.all_to_all(send_x, EXPERT, 0, 0)  # [S, A, dim]: from source s
    recv_w = jax.lax.all_to_all(send_w, EXPERT, 0, 0)
    recv_e = jax.lax.all_to_all(send_e, EXPERT, 0, 0)

    m = num_shards * a
    got_e = recv_e.reshape(m)
    order = jnp.argsort(got_e, stable=True)  # grouped by local expert, empty slots last
    xs = recv_x.reshape(m, dim)[order]
    ws = recv_w.reshape(m)[order]
    sizes = jnp.bincount(got_e, length=e_l + 1)[:e_l].astype(jnp.int32)

    def grouped(lhs, w):  # lhs [m, in] @ w [e_l, out, in]^T per group -> f32 [m, out]
        return jax.lax.ragged_dot(
            lhs, jnp.swapaxes(w, 1, 2), sizes, preferred_element_type=jnp.float32
        )

    g = grouped(xs, w1).astype(dt)
    u = grouped(xs, w3).astype(dt)
    act = (ws[:, None] * swiglu(g, u, limit)).astype(dt)
    if quant:  # fp8 blocks run along inter
        act = fp8_qdq(act, block)
    out = grouped(act, w2).astype(dt)  # [m, dim]
    out = jnp.where((got_e[order] < e_l)[:, None], out, 0)
    back = jnp.zeros_like(out).at[order].set(out).reshape(num_shards, a, dim)
    mine = jax.lax.all_to_all(back, EXPERT, 0, 0)  # [S, A, dim]: from destination d
    per_assignment = jnp.sum(mine.astype(jnp.float32), axis=0)  # one d is non-zero per slot
    return jnp.sum(per_assignment.reshape(n_l, k, dim), axis=1)

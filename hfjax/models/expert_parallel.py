"""Expert parallelism: a mixture of experts' experts split over the `expert` mesh axis, tokens
sent to their experts' devices by all-to-all and back.

On a mesh with `expert` > 1 the rules split every sparse layer's experts over `expert`
(`hfjax.parallel.sharding`, logical axis `expert`), and `expert` is also a data-parallel axis:
each device of an expert group holds different rows. `sparse_mlp` then runs as one
`shard_map` over the mesh:

1. each device routes its own tokens (the router is replicated);
2. it lays each (token, expert) assignment into a send buffer [ep, C, embed], one slot block per
   destination device (the device that holds the expert), with the expert's local index;
3. an all-to-all over `expert` delivers every device the rows for its own experts;
4. the device sorts what it received by local expert and runs the grouped matmuls on its
   E / ep experts only (`moe.dropless` on local ids);
5. a second all-to-all returns the outputs to the rows' devices, which weight and sum them.

C, the rows per (source, destination) block: dropless (`ragged`) takes the worst case, every
local assignment to one device (C = tokens x k), so nothing can be dropped; XLA:CPU has no
`ragged-all-to-all`, which would send only the rows that exist. `capacity` takes
C = ceil(capacity_factor x tokens x k / ep) and drops what overflows a block.

Expert weights enter the shard_map split over `expert` and whole along every other axis: a
device gathers its own experts' FSDP / tensor shards, never another device's experts.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from hfjax.models import backend, moe
from hfjax.models.config import ModelConfig
from hfjax.parallel import mesh as mesh_lib
from hfjax.parallel import sharding as shd

AXIS = "expert"


def expert_size(layout: shd.Layout | None) -> int:
    """The `expert` axis size of a layout's mesh (1: no expert parallelism)."""
    return 1 if layout is None else int(layout.mesh.shape.get(AXIS, 1))


def check(cfg: ModelConfig, layout: shd.Layout | None) -> None:
    """Refuses an expert axis that does not divide the experts (in one line)."""
    ep = expert_size(layout)
    if ep > 1 and cfg.num_experts % ep:
        raise ValueError(f"mesh axis expert={ep} does not divide num_experts="
                         f"{cfg.num_experts}; pick an expert size that divides it")


def block_rows(cfg: ModelConfig, tokens: int, ep: int, impl: str) -> int:
    """C: rows per (source, destination) block of the exchange for `tokens` local tokens."""
    k = cfg.num_experts_per_tok
    if impl == "capacity":
        return max(1, math.ceil(cfg.capacity_factor * tokens * k / ep))
    return tokens * k


def _local_experts(cfg: ModelConfig, p, rows, local_ids, n_local: int):
    """Grouped matmuls of received rows [M, D] on this device's experts; `local_ids` [M] is
    each row's local expert, n_local for an empty slot (sorted last, left out of every
    group: its output row is zero)."""
    dt = cfg.jnp_dtype
    order = jnp.argsort(local_ids, stable=True)
    sizes = jnp.bincount(local_ids, length=n_local + 1)[:n_local].astype(jnp.int32)
    xs = jnp.take(rows, order, axis=0)

    def grouped(x, w):
        return jax.lax.ragged_dot(x.astype(dt), w.astype(dt), sizes,
                                  preferred_element_type=jnp.float32)

    g, u = grouped(xs, p["expert_gate"]), grouped(xs, p["expert_up"])
    h = (jax.nn.silu(g) * u).astype(dt)
    out = grouped(h, p["expert_down"])
    return jnp.take(out, jnp.argsort(order), axis=0)


def sparse_mlp(cfg: ModelConfig, p, x: jax.Array, layout: shd.Layout, *,
               recorded: jax.Array | None = None, replay: bool = True,
               valid: jax.Array | None = None):
    """`moe.sparse_mlp` with the experts split over the `expert` axis of `layout`'s mesh."""
    check(cfg, layout)
    mesh = layout.mesh
    ep = expert_size(layout)
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    n_local = E // ep
    impl = backend.moe_impl(cfg.moe_impl)
    B, T, D = x.shape
    rows = mesh_lib.dp_axes(mesh)
    seq = "sequence" if mesh.shape.get("sequence", 1) > 1 else None
    tok = P(rows if rows else None, seq)
    weights = P(AXIS)
    valid = jnp.ones((B, T), bool) if valid is None else valid.astype(bool)
    given = recorded is not None
    recorded = (jnp.zeros((B, T, k), jnp.int32) if recorded is None
                else recorded.astype(jnp.int32))

    def local(x, router, wg, wu, wd, recorded_ids, valid):
        b, t, _ = x.shape
        n = b * t
        x2 = x.reshape(n, D)
        w, ids, logits, mismatch = moe.route(
            cfg, x2, router, recorded_ids.reshape(n, k) if given else None, replay)
        stats = moe.router_stats(cfg, logits, ids, mismatch, valid.reshape(n), (b, t))
        C = block_rows(cfg, n, ep, impl)
        flat = ids.T.reshape(-1)  # slot-major: every token's first choice first
        dest = flat // n_local
        onehot = jax.nn.one_hot(dest, ep, dtype=jnp.int32)
        pos = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=-1)
        keep = pos < C
        slot = jnp.where(keep, dest * C + pos, ep * C)
        src = jnp.tile(jnp.arange(n), k)
        send = jnp.zeros((ep * C, D), x2.dtype).at[slot].set(jnp.take(x2, src, axis=0),
                                                              mode="drop")
        send_ids = jnp.full((ep * C,), n_local, jnp.int32).at[slot].set(flat % n_local,
                                                                       mode="drop")
        recv = jax.lax.all_to_all(send.reshape(ep, C, D), AXIS, 0, 0, tiled=True)
        recv_ids = jax.lax.all_to_all(send_ids.reshape(ep, C), AXIS, 0, 0, tiled=True)
        out = _local_experts(cfg, {"expert_gate": wg, "expert_up": wu, "expert_down": wd},
                             recv.reshape(ep * C, D), recv_ids.reshape(-1), n_local)
        back = jax.lax.all_to_all(out.reshape(ep, C, D), AXIS, 0, 0, tiled=True)
        got = jnp.take(back.reshape(ep * C, D), jnp.minimum(slot, ep * C - 1), axis=0)
        got = (got * keep[:, None]).reshape(k, n, D)
        y = jnp.einsum("knd,nk->nd", got, w).astype(cfg.jnp_dtype).reshape(b, t, D)
        # Statistics over the whole batch: counts summed, losses averaged over the devices
        # that hold rows (every device does: `expert` is a data-parallel axis).
        axes = tuple(a for a in (*rows, *((seq,) if seq else ())))
        stats = moe.RouterStats(jax.lax.pmean(stats.aux_loss, axes),
                                jax.lax.pmean(stats.z_loss, axes),
                                jax.lax.psum(stats.counts, axes), stats.ids, stats.mismatch)
        return y, stats

    stats_spec = moe.RouterStats(P(), P(), P(), tok, tok)
    fn = jax.shard_map(local, mesh=mesh,
                       in_specs=(tok, P(), weights, weights, weights, tok, tok),
                       out_specs=(tok, stats_spec), check_vma=False)
    return fn(x, p["router"], p["expert_gate"], p["expert_up"], p["expert_down"], recorded,
              valid)

"""The sparse MLP of a mixture-of-experts decoder layer (Qwen3-MoE, Mixtral).

A router (a [embed, experts] matrix) scores every token; a softmax over the experts and a top-k
pick `num_experts_per_tok` of them, with weights that are the picked probabilities (renormalised
to sum to 1 with `norm_topk_prob`). Each token's output is the weighted sum of its experts' gated
MLPs. Experts are stored stacked, [layers, experts, ...], with the logical axis `expert`.

Two dispatches, chosen in `hfjax.models.backend.moe_impl`:

- "ragged" (dropless, the default): the (token, expert) assignments are sorted by expert and
  each expert's run of rows is multiplied by its own weights in one grouped matmul,
  `jax.lax.ragged_dot` (on CPU, whose compiler expands ragged_dot into a dense product per
  expert, batched matmuls over blocks of rows, one expert's each: `blocked_experts`). Every
  token reaches all k of its experts.
- "capacity": each expert takes at most C = ceil(capacity_factor * tokens * k / experts) rows
  into a fixed [experts, C, embed] buffer (top-1 choices first, then top-2, ...); rows past C
  are dropped (that expert contributes nothing to the token). Fixed shapes, dense batched
  matmuls.

Routing decisions are data. `sparse_mlp` returns each token's expert ids, and takes recorded
ids (the sampler's, `hfjax.engine.sampler`) to replay instead of its own top-k (routing
replay, `actor.router_replay`): the weights are then the current router's probabilities at
the replayed experts, so the router still trains. Given recorded ids, with replay or without,
it marks the tokens whose own top-k set differs from them (`RouterStats.mismatch`). A trainer
hands a batch's recorded ids to every forward pass it traces with `given_routing`.

Router statistics for the losses and the logs (`RouterStats`): the Switch / Qwen load-balancing
loss E * sum_e f_e * P_e (f_e the share of the batch's assignments that went to expert e, P_e
the mean router probability of e), the router z-loss mean(logsumexp(logits)^2), and the tokens
per expert. Padding tokens are routed (their outputs are discarded downstream) but do not count
in the statistics.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from typing import NamedTuple

import jax
import jax.numpy as jnp

from hfjax.models import backend
from hfjax.models.config import ModelConfig

# Parameter names of a sparse layer and of a dense layer's MLP (the latter are stacked over the
# dense layers only when a model mixes both).
SPARSE_PARAMS = ("router", "expert_gate", "expert_up", "expert_down")
DENSE_MLP_PARAMS = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")


class RouterStats(NamedTuple):
    """One sparse layer's routing of a batch (stacked over layers by the decoder's scan)."""

    aux_loss: jax.Array  # [] the load-balancing loss E * sum_e f_e * P_e (k when balanced)
    z_loss: jax.Array  # [] mean over tokens of logsumexp(router logits)^2
    counts: jax.Array  # [E] int32: (token, expert) assignments per expert
    ids: jax.Array  # [B, T, k] int32: each token's experts, in top-k order
    mismatch: jax.Array  # [B, T] bool: own top-k set != the recorded ids (False: none given)


def layer_kind(cfg: ModelConfig, name: str) -> str:
    """Which layers a stacked parameter `name` covers: "sparse", "dense" or "all"
    (`ModelConfig.layer_indices`)."""
    if not cfg.is_moe:
        return "all"
    if name in SPARSE_PARAMS:
        return "sparse"
    base = name.split("_lora_")[0]
    return "dense" if base in DENSE_MLP_PARAMS else "all"


def uniform(cfg: ModelConfig) -> bool:
    """Whether every layer holds the same parameters (dense, or every layer sparse): only then
    can the layers run under one `lax.scan` over the stacked arrays."""
    return len(set(cfg.sparse_layers())) == 1


def layer_slices(cfg: ModelConfig, stacked: dict[str, jax.Array]) -> list[dict[str, jax.Array]]:
    """Each layer's arrays from the stacked ones: an array stacked over a subset of the layers
    (`layer_kind`) gives its slices to those layers only."""
    out: list[dict[str, jax.Array]] = [{} for _ in range(cfg.num_layers)]
    for name, arr in stacked.items():
        for j, i in enumerate(cfg.layer_indices(layer_kind(cfg, name))):
            out[i][name] = arr[j]
    return out


# --- routing --------------------------------------------------------------------------------


def route(cfg: ModelConfig, x: jax.Array, router: jax.Array, recorded: jax.Array | None = None,
          replay: bool = True) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(weights [N, k] float32, expert ids [N, k] int32, router logits [N, E] float32,
    mismatch [N] bool) of tokens x [N, D]. The logits are accumulated in float32 from
    compute-dtype operands and the softmax is float32, as transformers computes them. With
    `recorded` ids [N, k]: `mismatch` marks the tokens whose own top-k set differs from
    them, and with `replay` the recorded experts are used, weighted by the current
    probabilities."""
    dt = cfg.jnp_dtype
    logits = jnp.dot(x.astype(dt), router.astype(dt), preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, ids = jax.lax.top_k(probs, cfg.num_experts_per_tok)
    mismatch = jnp.zeros(ids.shape[:1], bool)
    if recorded is not None:
        recorded = recorded.astype(jnp.int32)
        mismatch = jnp.any(jnp.sort(ids, axis=-1) != jnp.sort(recorded, axis=-1), axis=-1)
        if replay:
            ids = recorded
            weights = jnp.take_along_axis(probs, ids, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids.astype(jnp.int32), logits, mismatch


def router_stats(cfg: ModelConfig, logits: jax.Array, ids: jax.Array, mismatch: jax.Array,
                 valid: jax.Array | None, shape: tuple[int, int]) -> RouterStats:
    """`RouterStats` of logits [N, E], ids [N, k] and `route`'s mismatch [N] over the tokens
    `valid` [N] marks."""
    E = cfg.num_experts
    n = ids.shape[0]
    v = jnp.ones((n,), jnp.float32) if valid is None else valid.reshape(n).astype(jnp.float32)
    count = jnp.maximum(jnp.sum(v), 1.0)
    onehot = jax.nn.one_hot(ids, E, dtype=jnp.float32).sum(axis=1) * v[:, None]  # [N, E]
    counts = jax.lax.stop_gradient(onehot.sum(axis=0))
    mean_prob = jnp.sum(jax.nn.softmax(logits, axis=-1) * v[:, None], axis=0) / count
    aux = E * jnp.sum(counts / count * mean_prob)
    z = jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2 * v) / count
    return RouterStats(aux, z, counts.astype(jnp.int32), ids.reshape(*shape, -1),
                       mismatch.reshape(shape))


# --- dispatch -------------------------------------------------------------------------------


def _gated(cfg: ModelConfig, gate, up):
    return (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(cfg.jnp_dtype)


def _ragged(x: jax.Array, w: jax.Array, sizes: jax.Array, dtype) -> jax.Array:
    return jax.lax.ragged_dot(x.astype(dtype), w.astype(dtype), sizes,
                              preferred_element_type=jnp.float32).astype(dtype)


def dropless(cfg: ModelConfig, p, x: jax.Array, weights: jax.Array,
             ids: jax.Array) -> jax.Array:
    """sum_j weights[:, j] * expert_{ids[:, j]}(x) for x [N, D]: the assignments sorted by
    expert, one grouped matmul per projection (`jax.lax.ragged_dot`, or `blocked_experts`).
    Returns [N, D] float32."""
    N, k = ids.shape
    dt = cfg.jnp_dtype
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=cfg.num_experts).astype(jnp.int32)
    xs = jnp.take(x, order // k, axis=0)
    if backend.blocked_grouped_matmul():
        out = blocked_experts(cfg, p, xs, sizes)
    else:
        h = _gated(cfg, _ragged(xs, p["expert_gate"], sizes, dt),
                   _ragged(xs, p["expert_up"], sizes, dt))
        out = jax.lax.ragged_dot(h, p["expert_down"].astype(dt), sizes,
                                 preferred_element_type=jnp.float32)
    # Back to (token, slot) order: the inverse permutation is a gather, which differentiates
    # to a gather as well (a scatter-add would serialise on CPU).
    out = jnp.take(out, jnp.argsort(order), axis=0).reshape(N, k, -1)
    return jnp.einsum("nkd,nk->nd", out, weights)


def block_rows(rows: int, experts: int) -> int:
    """Rows per block of `blocked_experts` for `rows` assignments over `experts`: the power of
    two at or below the mean rows per expert, within [8, 128] (each expert wastes less than a
    block, so the blocks hold at most rows + experts x block rows)."""
    mean = max(1, rows // experts)
    return min(128, max(8, 1 << (mean.bit_length() - 1)))


def blocked_experts(cfg: ModelConfig, p, xs: jax.Array, sizes: jax.Array) -> jax.Array:
    """The experts' gated MLPs on rows xs [M, D] sorted by expert (`sizes` [E] rows each), as
    batched matmuls over blocks of `block_rows` rows: each expert's run of rows is padded to
    whole blocks and every block is multiplied by its expert's weights (gathered per block).
    The grouped matmul of `jax.lax.ragged_dot` for backends that expand ragged_dot densely
    (`backend.blocked_grouped_matmul`). Returns [M, D] float32."""
    M, D = xs.shape
    E, dt = cfg.num_experts, cfg.jnp_dtype
    B = block_rows(M, E)
    nb = -(-M // B) + E  # sum_e ceil(sizes_e / B) never exceeds it
    starts = jnp.cumsum(sizes) - sizes
    padded = (sizes + B - 1) // B * B
    ends = jnp.cumsum(padded)
    pstarts = ends - padded
    block_expert = jnp.minimum(jnp.searchsorted(ends, jnp.arange(nb) * B, side="right"), E - 1)
    row_expert = jnp.repeat(block_expert, B)
    rank = jnp.arange(nb * B) - pstarts[row_expert]
    filled = rank < sizes[row_expert]  # padding rows and unused blocks stay zero
    src = jnp.clip(starts[row_expert] + rank, 0, M - 1)
    buf = jnp.where(filled[:, None], jnp.take(xs, src, axis=0), 0).astype(dt).reshape(nb, B, D)

    def bmm(a, w):
        return jnp.einsum("bcd,bdf->bcf", a, jnp.take(w, block_expert, axis=0).astype(dt),
                          preferred_element_type=jnp.float32)

    h = _gated(cfg, bmm(buf, p["expert_gate"]), bmm(buf, p["expert_up"]))
    out = bmm(h, p["expert_down"]).reshape(nb * B, D)
    expert = jnp.repeat(jnp.arange(E), sizes, total_repeat_length=M)
    return jnp.take(out, pstarts[expert] + jnp.arange(M) - starts[expert], axis=0)


def capacity(cfg: ModelConfig, n_tokens: int) -> int:
    """Rows each expert takes under capacity dispatch for `n_tokens` tokens."""
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    return max(1, math.ceil(cfg.capacity_factor * n_tokens * k / E))


def capacity_dispatch(cfg: ModelConfig, p, x: jax.Array, weights: jax.Array,
                      ids: jax.Array) -> jax.Array:
    """As `dropless`, through [E, C, D] buffers (`capacity`): an assignment whose expert is
    full is dropped. Priority goes by top-k slot, then by token order. Returns [N, D] f32."""
    N, k = ids.shape
    E, C, dt = cfg.num_experts, capacity(cfg, N), cfg.jnp_dtype
    slot_major = ids.T.reshape(-1)  # [k * N]: every token's first choice before any second
    onehot = jax.nn.one_hot(slot_major, E, dtype=jnp.int32)
    pos = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=-1)
    keep = pos < C
    where = jnp.where(keep, slot_major * C + pos, E * C)  # E * C: out of bounds, dropped
    src = jnp.tile(jnp.arange(N), k)
    buf = jnp.zeros((E * C, x.shape[-1]), dt).at[where].set(
        jnp.take(x, src, axis=0).astype(dt), mode="drop").reshape(E, C, -1)

    def bmm(a, w):
        return jnp.einsum("ecd,edf->ecf", a, w.astype(dt),
                          preferred_element_type=jnp.float32).astype(dt)

    h = _gated(cfg, bmm(buf, p["expert_gate"]), bmm(buf, p["expert_up"]))
    out = jnp.einsum("ecf,efd->ecd", h, p["expert_down"].astype(dt),
                     preferred_element_type=jnp.float32).reshape(E * C, -1)
    got = jnp.take(out, jnp.minimum(where, E * C - 1), axis=0) * keep[:, None]
    got = got.reshape(k, N, -1)
    return jnp.einsum("knd,nk->nd", got, weights)


def sparse_mlp(cfg: ModelConfig, p, x: jax.Array, *, recorded: jax.Array | None = None,
               replay: bool = True, valid: jax.Array | None = None,
               ) -> tuple[jax.Array, RouterStats]:
    """The mixture of experts on x [B, T, D] (normed hidden states): (output [B, T, D] in the
    compute dtype, the layer's `RouterStats`). `recorded` [B, T, k] expert ids are compared
    with the router's own and, with `replay`, used (`route`); `valid` [B, T] marks the tokens
    the statistics count."""
    B, T, D = x.shape
    x2 = x.reshape(B * T, D)
    weights, ids, logits, mismatch = route(
        cfg, x2, p["router"], None if recorded is None else recorded.reshape(B * T, -1), replay)
    impl = backend.moe_impl(cfg.moe_impl)
    if impl == "capacity":
        y = capacity_dispatch(cfg, p, x2, weights, ids)
    else:
        y = dropless(cfg, p, x2, weights, ids)
    stats = router_stats(cfg, logits, ids, mismatch,
                         None if valid is None else valid.reshape(-1), (B, T))
    return y.astype(cfg.jnp_dtype).reshape(B, T, D), stats


def storage_ids(cfg: ModelConfig, ids: jax.Array) -> jax.Array:
    """Expert ids as a batch carries them: uint8 up to 256 experts, else int16."""
    return ids.astype(jnp.uint8 if cfg.num_experts <= 256 else jnp.int16)


# --- collecting statistics while a forward pass is traced -----------------------------------

_COLLECT: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "hfjax_moe_collect", default=None)


@contextlib.contextmanager
def collecting() -> Iterator[list[RouterStats]]:
    """Within: each decoder forward pass traced appends its sparse layers' `RouterStats`
    (stacked over those layers) to the yielded list; the values belong to the trace that ran
    the pass (a loss reads them in the same function)."""
    found: list[RouterStats] = []
    token = _COLLECT.set(found)
    try:
        yield found
    finally:
        _COLLECT.reset(token)


class Routing(NamedTuple):
    """A batch's recorded routing as a trainer hands it to the forward passes it traces."""

    ids: jax.Array  # [B, T, sparse layers, k] small ints: the sampler's experts per token
    replay: bool  # use them (routing replay); False: only compare (`RouterStats.mismatch`)


_GIVEN: contextvars.ContextVar[Routing | None] = contextvars.ContextVar(
    "hfjax_moe_given", default=None)


@contextlib.contextmanager
def given_routing(ids: jax.Array | None, replay: bool) -> Iterator[None]:
    """Within: each decoder forward pass traced without a cache and without its own `routing`
    takes `ids` [B, T, sparse layers, k] (rows and columns as its input ids) as the recorded
    routing (`Routing`). None: nothing given."""
    token = _GIVEN.set(None if ids is None else Routing(ids, replay))
    try:
        yield
    finally:
        _GIVEN.reset(token)


@contextlib.contextmanager
def regrouped(fn) -> Iterator[None]:
    """Within: the given routing's ids are `fn(ids)`, for a pass that lays the rows out
    differently (`fn` maps [B, T, ...] arrays as the pass maps its input ids)."""
    now = _GIVEN.get()
    token = _GIVEN.set(None if now is None else now._replace(ids=fn(now.ids)))
    try:
        yield
    finally:
        _GIVEN.reset(token)


def given() -> Routing | None:
    """The routing `given_routing` set, if any."""
    return _GIVEN.get()


def record(stats: RouterStats | None) -> None:
    """Hands a forward pass's stacked `RouterStats` to the active `collecting` list, if any."""
    target = _COLLECT.get()
    if target is not None and stats is not None:
        target.append(stats)


def stack(per_layer: list[RouterStats]) -> RouterStats | None:
    """Per-layer stats stacked on a leading layers axis (None for none)."""
    if not per_layer:
        return None
    return RouterStats(*(jnp.stack(xs) for xs in zip(*per_layer, strict=True)))


def load_spread(counts: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(least loaded expert's share of the mean load, most loaded's) over counts [..., E],
    the worst layer each: 1 and 1 when balanced, 0 for an unused expert."""
    c = counts.astype(jnp.float32)
    mean = jnp.maximum(jnp.mean(c, axis=-1), 1e-9)
    return jnp.min(jnp.min(c, axis=-1) / mean), jnp.max(jnp.max(c, axis=-1) / mean)


def merge(passes: list[RouterStats]) -> RouterStats:
    """One set of statistics from several forward passes' (a loss that ran the decoder more
    than once): losses averaged, counts summed, the first pass's ids."""
    if len(passes) == 1:
        return passes[0]
    return RouterStats(sum(s.aux_loss for s in passes) / len(passes),
                       sum(s.z_loss for s in passes) / len(passes),
                       sum(s.counts for s in passes), passes[0].ids, passes[0].mismatch)

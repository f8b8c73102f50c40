"""The continuous-batching program: decode slots, admission, retirement and the drain.

One jitted function, `run`, does a whole rollout of `hfjax.engine.continuous.ContinuousSampler`
(whose docstring explains the design): it prefills prompts in windows, admits requests into
free slots, decodes, retires finished requests to their output rows and, once nothing waits,
gathers the busy slots into fewer slots phase by phase. `Plan` is its compile-cache key.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hfjax.engine.decode import (
    CPU_OPTIONS,
    DecodeOptions,
    LayerCache,
    cache_and_row_shardings,
    cache_from_prefill,
    decode_step,
    empty_cache,
    split_layers,
)
from hfjax.engine.token_select import GenerateOutput, Knobs, select_tokens
from hfjax.models.config import ModelConfig
from hfjax.models.transformer import KVCache, positions_from_mask


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything that changes the program's shapes or structure: its compile-cache key.

    The token-selection fields (greedy, top_k, use_top_p, use_min_p) are those that
    `select_tokens` reads.
    """

    prompts: int  # prompt rows uploaded (the batch padded to the data-parallel size)
    prompt_bucket: int
    new_bucket: int
    n: int
    slots: int
    prefill_batch: int  # prompts per prefill window (G)
    admit_rows: int  # requests per admission round
    refill_every: int  # decode steps between refills (k)
    drain: tuple[int, ...]  # slot counts of the drain phases after the first, decreasing
    greedy: bool
    top_k: int
    use_top_p: bool
    use_min_p: bool
    num_stops: int
    decode: DecodeOptions = CPU_OPTIONS  # how decode steps read and lay out the cache

    @property
    def columns(self) -> int:
        """Cache columns of one slot."""
        return self.prompt_bucket + self.new_bucket


class _Slots(NamedTuple):
    """The decode slots; `req` is -1 on a free slot."""

    cache: tuple[LayerCache, ...]  # per layer: [slots, kv_heads, ...] prompt and response parts
    req: jax.Array  # int32 [slots]: the request decoding here, -1 when free
    t: jax.Array  # int32 [slots]: response tokens emitted so far
    last: jax.Array  # int32 [slots]: the token fed at the next step
    done: jax.Array  # bool [slots]: stopped (stop token or max_new tokens), not yet retired
    lengths: jax.Array  # int32 [slots]: real prompt length (position of response token 0)
    keys: jax.Array  # PRNG keys [slots]: the request's key (its prompt key, sample folded in)
    attn: jax.Array  # int32 [slots, columns]: prompt mask, then ones for the response columns
    tokens: jax.Array  # int32 [slots, new_bucket]: the request's response so far
    mask: jax.Array  # int32 [slots, new_bucket]
    logprobs: jax.Array  # float32 [slots, new_bucket]


class _Stage(NamedTuple):
    """The prefill window: prompts lo .. lo + G - 1."""

    lo: jax.Array  # int32 []
    cache: tuple[LayerCache, ...]  # per layer: [G, kv_heads, ...] prompt parts (no response)
    logits: jax.Array  # float32 [G, vocab]: each prompt's last-position logits


class _State(NamedTuple):
    slots: _Slots
    stage: _Stage
    next: jax.Array  # int32 []: the next request to admit
    steps: jax.Array  # int32 []: decode steps run
    slot_steps: jax.Array  # int32 []: rows those steps computed (slots x steps, summed)
    prefills: jax.Array  # int32 []: prefill windows run
    tokens: jax.Array  # int32 [prompts * n, new_bucket]: the output rows
    mask: jax.Array
    logprobs: jax.Array


class _Inputs(NamedTuple):
    """Per-call inputs, closed over by the loop."""

    ids: jax.Array  # int32 [prompts, prompt_bucket], left-padded
    mask: jax.Array  # int32 [prompts, prompt_bucket]
    prompt_keys: jax.Array  # PRNG keys [prompts]
    total: jax.Array  # int32 []: real requests (batch * n); later rows are padding
    knobs: Knobs
    stops: jax.Array  # int32 [num_stops]


# --------------------------------------------------------------------------------------------
# Shardings
# --------------------------------------------------------------------------------------------


class _Shardings(NamedTuple):
    slots: _Slots
    stage: _Stage
    rows: NamedSharding  # output rows, as the static engine returns them


def run_shardings(mesh: Mesh, cfg: ModelConfig, layout: str = "cpu") -> _Shardings:
    """Slots and staged prompts split over the data-parallel axes, kv-heads over `tensor` when
    it divides them (as the static engine's cache); everything else replicated."""
    layer, row = cache_and_row_shardings(mesh, cfg, layout)
    cache = tuple(LayerCache(layer, layer, layer, layer) for _ in range(cfg.num_layers))
    slots = _Slots(cache, *([row] * (len(_Slots._fields) - 1)))
    return _Shardings(slots, _Stage(NamedSharding(mesh, P()), cache, row), row)


def _constrain(x: Any, shardings: Any) -> Any:
    return x if shardings is None else jax.lax.with_sharding_constraint(x, shardings)


# --------------------------------------------------------------------------------------------
# The program's pieces
# --------------------------------------------------------------------------------------------


def _fold(keys: jax.Array, data: jax.Array) -> jax.Array:
    return jax.vmap(jax.random.fold_in)(keys, data)


def _prefill(model, plan: Plan, x: _Inputs, lo: jax.Array) -> tuple[tuple[LayerCache, ...], Any]:
    """KV cache and last-position logits of prompts lo .. lo + G - 1."""
    g, width = plan.prefill_batch, plan.prompt_bucket
    ids = jax.lax.dynamic_slice(x.ids, (lo, 0), (g, width))
    mask = jax.lax.dynamic_slice(x.mask, (lo, 0), (g, width))
    cache = KVCache.zeros(model.config, g, width)
    hidden, cache = model.model(
        ids, mask, positions=positions_from_mask(mask), cache=cache, cache_index=0
    )
    # Left padding puts every prompt's last token in the last column.
    return cache_from_prefill(cache, 1, 0, plan.decode.layout), model.logits(hidden[:, -1])


def _admit(plan: Plan, x: _Inputs, st: _State) -> _State:
    """Admits up to `admit_rows` waiting requests whose prompts are in the staging window into
    free slots (lowest slot first), each with its first response token sampled."""
    s, stage, a = st.slots, st.stage, plan.admit_rows
    n, new = plan.n, plan.new_bucket
    free = s.req < 0
    window_end = jnp.minimum((stage.lo + plan.prefill_batch) * n, x.total)
    count = jnp.minimum(jnp.minimum(jnp.sum(free, dtype=jnp.int32), window_end - st.next), a)
    i = jnp.arange(a, dtype=jnp.int32)
    # Slot indices past the last slot are dropped by every scatter below.
    dst = jnp.where(i < count, jnp.nonzero(free, size=a, fill_value=plan.slots)[0], plan.slots)
    req = st.next + i
    prompt = jnp.minimum(req // n, plan.prompts - 1)
    src = jnp.clip(prompt - stage.lo, 0, plan.prefill_batch - 1)

    def put(arr, val):
        return arr.at[dst].set(val, mode="drop")

    # The prompt's staged keys and values become the slot's prompt part.
    cache = tuple(
        c._replace(
            prompt_k=c.prompt_k.at[dst].set(sc.prompt_k[src], mode="drop"),
            prompt_v=c.prompt_v.at[dst].set(sc.prompt_v[src], mode="drop"),
        )
        for c, sc in zip(s.cache, stage.cache)
    )
    pmask = x.mask[prompt]
    keys = _fold(x.prompt_keys[prompt], req % n)
    # Response token 0 comes from the prompt's staged logits, with the key the static engine
    # uses for it (token index 0 folded in).
    tok, lp = select_tokens(stage.logits[src], _fold(keys, jnp.zeros_like(req)), plan, x.knobs)
    hit = jnp.any(tok[:, None] == x.stops[None, :], axis=-1)
    first = jnp.arange(new)[None, :] == 0
    slots = s._replace(
        cache=cache,
        req=put(s.req, req),
        t=put(s.t, jnp.ones_like(req)),
        last=put(s.last, tok),
        done=put(s.done, hit | (x.knobs.max_new <= 1)),
        lengths=put(s.lengths, jnp.sum(pmask, axis=-1, dtype=jnp.int32)),
        keys=put(s.keys, keys),
        attn=put(s.attn, jnp.concatenate([pmask, jnp.ones((a, new), jnp.int32)], axis=1)),
        tokens=put(s.tokens, jnp.where(first, tok[:, None], x.knobs.pad_id)),
        mask=put(s.mask, first.astype(jnp.int32) + jnp.zeros((a, 1), jnp.int32)),
        logprobs=put(s.logprobs, jnp.where(first, lp[:, None], 0.0)),
    )
    return st._replace(slots=slots, next=st.next + count)


def _retire(plan: Plan, st: _State) -> _State:
    """Copies every finished slot's response to its request's output row and frees the slot."""
    s = st.slots
    fin = (s.req >= 0) & s.done
    rows = jnp.where(fin, s.req, plan.prompts * plan.n)  # past the last row: dropped
    return st._replace(
        slots=s._replace(req=jnp.where(fin, -1, s.req), done=s.done & ~fin),
        tokens=st.tokens.at[rows].set(s.tokens, mode="drop"),
        mask=st.mask.at[rows].set(s.mask, mode="drop"),
        logprobs=st.logprobs.at[rows].set(s.logprobs, mode="drop"),
    )


def _refill(model, plan: Plan, x: _Inputs, shardings, st: _State) -> _State:
    """Retires finished slots, then admits waiting requests into free slots, prefilling the
    next window of prompts whenever the next request's prompt lies past the current one."""
    st = _retire(plan, st)

    def more(st: _State) -> jax.Array:
        return jnp.any(st.slots.req < 0) & (st.next < x.total)

    def admit(st: _State) -> _State:
        prompt = st.next // plan.n

        def prefill() -> _Stage:
            # The last window is shifted back so that it stays inside the prompt rows.
            lo = jnp.minimum(prompt, plan.prompts - plan.prefill_batch)
            cache, logits = _prefill(model, plan, x, lo)
            return _constrain(_Stage(lo, cache, logits), shardings and shardings.stage)

        need = prompt >= st.stage.lo + plan.prefill_batch
        stage = jax.lax.cond(need, prefill, lambda: st.stage)
        st = _admit(plan, x, st._replace(stage=stage, prefills=st.prefills + need))
        return st._replace(slots=_constrain(st.slots, shardings and shardings.slots))

    return jax.lax.while_loop(more, admit, st)


def _step(model, layers, plan: Plan, x: _Inputs, shardings, s: _Slots) -> _Slots:
    """One decode step of every slot; only live slots (admitted, not stopped) record it."""
    live = (s.req >= 0) & ~s.done
    # Token t - 1 is fed at column prompt_bucket + t - 1 and position length + t - 1. Free and
    # finished slots compute too (fixed shapes); what they write stays in their own rows.
    col = plan.prompt_bucket + s.t - 1
    logits, cache = decode_step(model, layers, s.last, s.lengths + s.t - 1, s.attn, s.cache, col,
                                plan.decode)
    tok, lp = select_tokens(logits, _fold(s.keys, s.t), plan, x.knobs)
    # A select over the small [slots, new_bucket] history rather than a scatter: elementwise,
    # so it stays on each device's own rows.
    at = live[:, None] & (jnp.arange(plan.new_bucket)[None, :] == s.t[:, None])
    hit = jnp.any(tok[:, None] == x.stops[None, :], axis=-1)
    t = s.t + live.astype(jnp.int32)
    s = s._replace(
        cache=cache,
        t=t,
        last=jnp.where(live, tok, s.last),
        done=s.done | (live & (hit | (t >= x.knobs.max_new))),
        tokens=jnp.where(at, tok[:, None], s.tokens),
        mask=jnp.where(at, 1, s.mask),
        logprobs=jnp.where(at, lp[:, None], s.logprobs),
    )
    return _constrain(s, shardings and shardings.slots)


def _init(model, plan: Plan, x: _Inputs) -> _State:
    cfg = model.config
    slots, cols, new = plan.slots, plan.columns, plan.new_bucket
    rows_out = plan.prompts * plan.n
    g = plan.prefill_batch
    return _State(
        # A free slot attends to its own (finite) columns: no row ever sees NaN, so a slot's
        # stale columns, masked out after it is reused, stay harmless.
        slots=_Slots(
            cache=empty_cache(cfg, slots, plan.prompt_bucket, new, plan.decode.layout),
            req=jnp.full((slots,), -1, jnp.int32),
            t=jnp.zeros((slots,), jnp.int32),
            last=jnp.zeros((slots,), jnp.int32),
            done=jnp.zeros((slots,), bool),
            lengths=jnp.ones((slots,), jnp.int32),
            keys=jax.random.split(jax.random.key(0), slots),
            attn=jnp.ones((slots, cols), jnp.int32),
            tokens=jnp.zeros((slots, new), jnp.int32),
            mask=jnp.zeros((slots, new), jnp.int32),
            logprobs=jnp.zeros((slots, new), jnp.float32),
        ),
        # lo = -G: the first request's prompt lies past this empty window.
        stage=_Stage(
            lo=jnp.int32(-g),
            cache=empty_cache(cfg, g, plan.prompt_bucket, 0, plan.decode.layout),
            logits=jnp.zeros((g, cfg.vocab_size), jnp.float32),
        ),
        next=jnp.int32(0),
        steps=jnp.int32(0),
        slot_steps=jnp.int32(0),
        prefills=jnp.int32(0),
        tokens=jnp.full((rows_out, new), x.knobs.pad_id, jnp.int32),
        mask=jnp.zeros((rows_out, new), jnp.int32),
        logprobs=jnp.zeros((rows_out, new), jnp.float32),
    )


def _compact(st: _State, rows: int, shardings) -> _State:
    """Moves the busy slots (at most `rows` of them) into `rows` slots, in slot order."""
    s = st.slots
    busy = s.req >= 0
    # Slots past the busy ones copy some slot's (finite) rows and are marked free.
    idx = jnp.nonzero(busy, size=rows, fill_value=0)[0]
    keep = jnp.arange(rows) < jnp.sum(busy, dtype=jnp.int32)
    slots = jax.tree.map(lambda a: a[idx], s)
    slots = slots._replace(req=jnp.where(keep, slots.req, -1))
    return st._replace(slots=_constrain(slots, shardings and shardings.slots))


def run(
    graphdef: nnx.GraphDef,
    plan: Plan,
    shardings: _Shardings | None,
    state: nnx.State,
    ids: jax.Array,
    mask: jax.Array,
    seeds: jax.Array,
    salts: jax.Array,
    total: jax.Array,
    knobs: Knobs,
    stops: jax.Array,
) -> tuple[GenerateOutput, dict[str, jax.Array]]:
    """The whole continuous-batching rollout: every request admitted, decoded and retired.

    Returns the output rows and counters (decode steps, slot-steps: the rows those steps
    computed, prefill windows)."""
    model = nnx.merge(graphdef, state)
    layers = split_layers(model)  # outside the loops: sliced once per call, not per step
    prompt_keys = jax.vmap(lambda s, salt: jax.random.fold_in(jax.random.key(s), salt))(
        seeds, salts
    )
    x = _Inputs(ids, mask.astype(jnp.int32), prompt_keys, total, knobs, stops)
    st = _init(model, plan, x)
    st = st._replace(slots=_constrain(st.slots, shardings and shardings.slots))

    def busy_slots(s: _Slots) -> jax.Array:
        return jnp.sum(s.req >= 0, dtype=jnp.int32)

    def decode(st: _State, limit: int | jax.Array) -> _State:
        """Up to k decode steps, fewer once at most `limit` slots are still decoding; then
        retires the finished slots."""

        def go(c):
            i, s = c
            return (i < plan.refill_every) & (jnp.sum((s.req >= 0) & ~s.done) > limit)

        def step(c):
            i, s = c
            return i + 1, _step(model, layers, plan, x, shardings, s)

        steps, slots = jax.lax.while_loop(go, step, (jnp.int32(0), st.slots))
        rows = slots.req.shape[0]
        st = st._replace(
            slots=slots, steps=st.steps + steps, slot_steps=st.slot_steps + steps * rows
        )
        return _retire(plan, st)

    sizes = (plan.slots, *plan.drain)
    first_limit = sizes[1] if len(sizes) > 1 else 0

    def admit_then_drain(st: _State) -> _State:
        # While requests wait: refill, then decode (limit 0). Then the first drain phase, on
        # the same slots: decode until at most the next phase's slot count is busy. One loop,
        # so that the decode step at `plan.slots` rows is compiled once, not twice.
        waiting = st.next < x.total
        st = jax.lax.cond(waiting, lambda st: _refill(model, plan, x, shardings, st),
                          lambda st: st, st)
        return decode(st, jnp.where(waiting, 0, first_limit))

    st = jax.lax.while_loop(
        lambda st: (st.next < x.total) | (busy_slots(st.slots) > first_limit),
        admit_then_drain,
        st,
    )
    # Drain: nothing waits any more; as slots finish, the busy ones move into fewer slots, so
    # a long last request does not keep every slot's rows computing.
    for i, rows in enumerate(sizes[1:], 1):
        st = _compact(st, rows, shardings)
        limit = sizes[i + 1] if i + 1 < len(sizes) else 0
        st = jax.lax.while_loop(
            lambda st, limit=limit: busy_slots(st.slots) > limit,
            lambda st, limit=limit: decode(st, limit),
            st,
        )
    out = GenerateOutput(st.tokens, st.mask, st.logprobs)
    if shardings is not None:
        out = _constrain(out, GenerateOutput(*[shardings.rows] * 3))
    stats = {"decode_steps": st.steps, "slot_steps": st.slot_steps, "prefill_windows": st.prefills}
    return out, stats

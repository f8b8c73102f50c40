"""Turns that keep their cache: a decode session whose rows pause between turns.

A multi-turn rollout (`hfjax.agents.loop`) decodes a policy turn, hands the row to its tools,
and decodes the next turn once their results are back. A `TurnSession` keeps each row's KV cache
across that wait, so the next turn prefills only what is new: the tool's result.

**Layout.** The session is the static engine's decode state (`hfjax.engine.sampler`) with one
change: every row has its own response index `t`. A row's cache has the prompt's bucket of
columns (left-padded, filled by the first prefill) and `width` response columns; response
token j, generated or observed, sits at response column j, at RoPE position prompt length + j,
as it would in a prefill of the whole context. `decode_step` already writes one column per
row, so rows at different indices decode in one step.

**Programs.** Two, each one jitted program per shape:
- `open`: the first turn, the static engine's own prefill (n samples per prompt, the
  caller's seeds) followed by the session's decode loop;
- `resume`: the next turn of some rows (those whose tools are done). Their rows are gathered
  out of the session (their count padded to a power of two, at least 8, and to the
  data-parallel size),
  their new tokens (the last token of their turn, whose key and value no step has written yet,
  then the tool's result) are prefilled in one forward pass against the kept cache
  (`_extend_layer`), the turn's first token is drawn from the last new position's logits, the
  decode loop runs until each of them has stopped, and the rows go back in place.
The new tokens travel in a window of `chunk` columns (a power of two, at least 16, at most
`width`), so a run compiles a few resume programs: one per (window, rows resumed) pair of
powers of two. A window that would pass the cache's end is moved back; columns it covers that
are not new keep their values.

**Rows that are not resuming** (waiting for a tool, or finished) are not computed: they stay
parked in the session. Within a decode loop, as in the static engine, a row that has stopped is
computed with the others until the last one stops; it feeds its last token at its current
column, which its next resume writes first, so nothing it attends to later changes.

**Seeds.** The first turn keys its rows as the static engine does (`fold_in(key(seed_b),
salt_b)`, sample j, token t). A later turn takes one seed per row (the loop's `_turn_seed`) and
keys it as the static engine keys prompt 0 of a per-prompt seed array, sample 0: token k of the
turn folds in k. So a turn draws what the static engine draws for that row's whole context
with that seed: only the prefill's arithmetic differs (tests/engine/test_session.py checks
tokens and log-probs against re-prefilling each turn).
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx

from hfjax.engine.buckets import bucket_size
from hfjax.engine.decode import (
    DecodeOptions,
    LayerCache,
    cache_and_row_shardings,
    decode_step,
    split_layers,
)
from hfjax.engine.sampler import Sampler, _prefill
from hfjax.engine.token_select import Knobs, SamplingParams, Static, select_tokens
from hfjax.models.backend import storage_dtype
from hfjax.models.rope import rope_inv_freq, rope_tables
from hfjax.models.transformer import (
    attention_inputs,
    layer_output,
    rms_norm,
)
from hfjax.parallel import mesh as mesh_lib
from hfjax.parallel import sharding as sharding_lib

MIN_CHUNK = 16  # columns of the narrowest resume window
MIN_ROWS = 8  # rows of the narrowest resume batch


class Session(NamedTuple):
    """The decode state of a session's rows (module docstring)."""

    cache: tuple[LayerCache, ...]  # per layer: prompt part, then `width` response columns
    t: jax.Array  # int32 [rows]: response tokens so far (the next one's column)
    start: jax.Array  # int32 [rows]: the column of the current turn's first token
    last: jax.Array  # int32 [rows]: the last token drawn (its key and value not yet cached)
    live: jax.Array  # bool [rows]: decoding in the current turn
    lengths: jax.Array  # int32 [rows]: real prompt lengths (position of response token 0)
    keys: jax.Array  # PRNG keys [rows]: the current turn's row key
    attn: jax.Array  # int32 [rows, columns]: prompt mask, then ones for the response columns
    tokens: jax.Array  # int32 [rows, width]: drawn tokens at their response columns
    logprobs: jax.Array  # float32 [rows, width]


def _shardings(mesh, cfg, layout: str) -> Session:
    layer, row = cache_and_row_shardings(mesh, cfg, layout)
    return Session(cache=tuple(LayerCache(layer, layer, layer, layer)
                               for _ in range(cfg.num_layers)),
                   t=row, start=row, last=row, live=row, lengths=row, keys=row, attn=row,
                   tokens=row, logprobs=row)


def _constrain(s: Session, shardings: Session | None) -> Session:
    return s if shardings is None else jax.lax.with_sharding_constraint(s, shardings)


def _record(s: Session, tok, lp, stops, knobs: Knobs) -> Session:
    """Writes each live row's token at its column t, advances it, and ends the rows that drew
    a stop token or filled the response budget (`knobs.max_new`)."""
    live = s.live
    here = live[:, None] & (jnp.arange(s.tokens.shape[1])[None, :] == s.t[:, None])
    hit = jnp.any(tok[:, None] == stops[None, :], axis=-1)
    t = s.t + live.astype(jnp.int32)
    return s._replace(
        t=t,
        last=jnp.where(live, tok, s.last),
        live=live & ~hit & (t < knobs.max_new),
        tokens=jnp.where(here, tok[:, None], s.tokens),
        logprobs=jnp.where(here, lp[:, None], s.logprobs),
    )


def _turn_loop(model, layers, static: Static, opts: DecodeOptions, shardings, s: Session,
               knobs: Knobs, stops) -> Session:
    """Decodes the live rows, one token per step, until none is live."""

    def body(s: Session) -> Session:
        # The last token goes to its column (prompt bucket + t - 1) at position length + t - 1;
        # token k of the turn folds k into the turn's key.
        logits, cache = decode_step(model, layers, s.last, s.lengths + s.t - 1, s.attn,
                                    s.cache, static.prompt_bucket + s.t - 1, opts)
        keys = jax.vmap(jax.random.fold_in)(s.keys, s.t - s.start)
        tok, lp = select_tokens(logits, keys, static, knobs)
        return _constrain(_record(s._replace(cache=cache), tok, lp, stops, knobs), shardings)

    return jax.lax.while_loop(lambda s: jnp.any(s.live), body, s)


def _open(graphdef, static: Static, opts: DecodeOptions, shardings, state, ids, mask, seeds,
          salts, knobs: Knobs, stops) -> Session:
    """The first turn: the static engine's prefill and first token, then the decode loop."""
    c = _prefill(graphdef, static, opts, None, state, ids, mask, seeds, salts, knobs, stops)
    rows = c.tokens.shape[0]
    one = jnp.ones((rows,), jnp.int32)
    s = Session(cache=c.cache, t=one, start=jnp.zeros((rows,), jnp.int32), last=c.last,
                live=~c.done & (1 < knobs.max_new), lengths=c.lengths, keys=c.keys,
                attn=c.attn, tokens=c.tokens, logprobs=c.logprobs)
    s = _constrain(s, shardings)
    model = nnx.merge(graphdef, state)
    return _turn_loop(model, split_layers(model), static, opts, shardings, s, knobs, stops)


def _extend_layer(cfg, rope, p, h, kv: LayerCache, at, new, ok, layout: str):
    """One decoder layer over a window of new tokens h [R, C, D] that starts at response
    column `at` [R]: writes the keys and values of the columns `new` [R, C] marks, then attends
    each position to the prompt (`ok` [R, P]) and to the response columns up to its own."""
    R, C = h.shape[:2]
    K, H = cfg.num_kv_heads, cfg.head_dim
    G = cfg.num_heads // K
    q, k, v = attention_inputs(cfg, rope, p, h)
    gpu = layout == "gpu"
    if not gpu:  # the cache's own layouts: keys [K, H, cols], values [K, cols, H] per row
        k, v = jnp.transpose(k, (0, 2, 3, 1)), jnp.transpose(v, (0, 2, 1, 3))
    k_axis, v_axis = (0, 0) if gpu else (2, 1)

    def put(cache, x, start, keep, axis):
        old = jax.lax.dynamic_slice_in_dim(cache, start, C, axis=axis)
        shape = [1] * cache.ndim
        shape[axis] = C
        x = jnp.where(keep.reshape(shape), x.astype(cache.dtype), old)
        return jax.lax.dynamic_update_slice_in_dim(cache, x, start, axis=axis)

    ck = jax.vmap(functools.partial(put, axis=k_axis))(kv.k, k, at, new)
    cv = jax.vmap(functools.partial(put, axis=v_axis))(kv.v, v, at, new)

    qg = jnp.transpose(q.reshape(R, C, K, G, H), (0, 2, 3, 1, 4))  # [R, K, G, C, H]
    kform, vform = ("bskh", "bskh") if gpu else ("bkhs", "bksh")
    scores = [jnp.einsum(f"bkgch,{kform}->bkgcs", qg, keys, preferred_element_type=jnp.float32)
              for keys in (kv.prompt_k, ck)]
    width = ck.shape[1] if gpu else ck.shape[-1]
    own = jnp.arange(width)[None, None, :] <= (at[:, None] + jnp.arange(C)[None, :])[:, :, None]
    masks = (jnp.broadcast_to(ok[:, None, :], (R, C, ok.shape[1])), own)
    s = jnp.concatenate([jnp.where(m[:, None, None], x / math.sqrt(H), jnp.finfo(jnp.float32).min)
                         for x, m in zip(scores, masks)], axis=-1)
    probs = jax.nn.softmax(s, axis=-1).astype(qg.dtype)
    split = scores[0].shape[-1]
    out = sum(jnp.einsum(f"bkgcs,{vform}->bkgch", pr, vals, preferred_element_type=jnp.float32)
              for pr, vals in ((probs[..., :split], kv.prompt_v), (probs[..., split:], cv)))
    attn = jnp.transpose(out.astype(qg.dtype), (0, 3, 1, 2, 4)).reshape(R, C, K * G, H)
    return layer_output(cfg, p, h, attn), kv._replace(k=ck, v=cv)


def _resume(graphdef, static: Static, opts: DecodeOptions, shardings, state, s: Session,
            rows, go, window, at, new, pick, seeds, knobs: Knobs, stops) -> Session:
    """The next turn of session rows `rows` [S] (`go` [S] marks the real entries; the others
    repeat a real one and are dropped): their rows are gathered out of the session, their new
    tokens `window` [S, C] (marked by `new`, starting at response column `at`) are prefilled
    into the kept cache, the first token is drawn from position `pick` [S] of the window, the
    decode loop runs, and the rows go back in place. The session's other rows are not
    computed."""
    model = nnx.merge(graphdef, state)
    cfg = model.config
    layers = split_layers(model)
    sub = _constrain(jax.tree.map(lambda x: x[rows], s), shardings)
    width = sub.tokens.shape[1]
    P_ = static.prompt_bucket
    positions = sub.lengths[:, None] + at[:, None] + jnp.arange(window.shape[1])[None, :]
    rope = rope_tables(positions, rope_inv_freq(cfg), storage_dtype(cfg.jnp_dtype),
                       P_ + width)
    h = model.model.embed(window)
    ok = sub.attn[:, :P_].astype(bool)
    cache = []
    for p, kv in zip(layers, sub.cache):
        h, kv = _extend_layer(cfg, rope, p, h, kv, at, new & go[:, None], ok, opts.layout)
        cache.append(kv)
    h = jnp.take_along_axis(h, pick[:, None, None], axis=1)[:, 0]
    logits = model.logits(rms_norm(h, model.model.norm[...], cfg.rms_norm_eps))
    # As the static engine keys prompt 0 of a per-prompt seed array, sample 0.
    keys = jax.vmap(lambda x: jax.random.fold_in(jax.random.fold_in(jax.random.key(x), 0), 0))(
        seeds)
    t = at + pick + 1  # the turn's first token's column
    sub = sub._replace(cache=tuple(cache), keys=keys, t=t, start=t, live=go)
    tok, lp = select_tokens(logits, jax.vmap(jax.random.fold_in)(keys, jnp.zeros_like(t)),
                            static, knobs)
    sub = _constrain(_record(sub, tok, lp, stops, knobs), shardings)
    sub = _turn_loop(model, layers, static, opts, shardings, sub, knobs, stops)
    back = jnp.where(go, rows, s.t.shape[0])  # padding entries fall outside: dropped
    return _constrain(jax.tree.map(lambda x, y: x.at[back].set(y, mode="drop"), s, sub),
                      shardings)


# --------------------------------------------------------------------------------------------
# The host side
# --------------------------------------------------------------------------------------------


class TurnEngine:
    """The session programs of one `Sampler` (its model structure, mesh, layout and decode
    options), compiled once per shape and reused by every session opened on it."""

    def __init__(self, sampler: Sampler):
        self.sampler = sampler
        s = sampler
        self._shardings = (_shardings(s.mesh, s.config, s.decode.layout)
                           if s.mesh is not None else None)
        self._programs: dict[tuple, Any] = {}
        self.compile_log: list[tuple] = []  # one entry per compiled program, in order

    def _program(self, kind: str, static: Static, shape: tuple[int, int] = (0, 0)) -> Any:
        key = (kind, static, shape)
        fn = self._programs.get(key)
        if fn is None:
            s = self.sampler
            logging.info("hfjax.engine: compiling session %s for rows=%d prompt_bucket=%d "
                         "width=%d (window, rows resumed)=%s mesh=%s", kind,
                         static.batch * static.n, static.prompt_bucket, static.new_bucket, shape,
                         dict(s.mesh.shape) if s.mesh is not None else None)
            body = _open if kind == "open" else _resume
            fn = functools.partial(body, s.graphdef, static, s.decode, self._shardings)
            fn = jax.jit(sharding_lib.under_layout(s._trace_layout, fn),
                         donate_argnums=() if kind == "open" else (1,))
            self._programs[key] = fn
            self.compile_log.append(key)
        return fn

    def _put(self, rows: tuple, everywhere: tuple) -> tuple[tuple, tuple]:
        """The request's deliberate uploads: per-row arrays split over the data-parallel axes,
        the rest replicated."""
        mesh = self.sampler.mesh
        if mesh is None:
            return rows, everywhere
        with jax.transfer_guard("allow"):
            return (jax.device_put(rows, mesh_lib.batch_sharding(mesh)),
                    jax.device_put(everywhere, mesh_lib.replicated(mesh)))

    def open(self, state: nnx.State, input_ids, attention_mask, params: SamplingParams,
             seed) -> TurnSession:
        """The first turn of `params.n` samples per left-padded prompt, as
        `Sampler.generate` draws it (the same seeds, rows b * n + j), with a budget of
        `params.max_new_tokens` response tokens per row over all its turns. Returns the
        session, its first turn decoded."""
        s = self.sampler
        ids, mask, seeds, salts, batch = s._prepare(input_ids, attention_mask, seed)
        static = s.static_for(ids.shape[0], ids.shape[1], params)
        knobs = s._knobs(params)
        stops = np.asarray(params.eos_ids, np.int32).reshape(-1)
        state = s.place(state)
        (ids, mask, seeds, salts), (knobs, stops) = self._put((ids, mask, seeds, salts),
                                                              (knobs, stops))
        session = self._program("open", static)(state, ids, mask, seeds, salts, knobs, stops)
        return TurnSession(self, state, static, knobs, stops, session, batch * params.n)


class TurnSession:
    """One multi-turn rollout's kept caches (module docstring): `turns()` reads the last turn
    of every row, `resume(...)` decodes the next turn of some rows."""

    def __init__(self, engine: TurnEngine, state, static: Static, knobs, stops, session: Session,
                 rows: int):
        self.engine, self.state, self.static = engine, state, static
        self.knobs, self.stops, self.session = knobs, stops, session
        self.rows = rows  # real rows; the session may hold padding rows after them
        self.prefilled = 0  # tokens the resumes prefilled (real rows)

    @property
    def width(self) -> int:
        """Response columns of a row's cache."""
        return self.static.new_bucket

    def turns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The host fetch of a turn: (tokens [rows, width], log-probs, start [rows], t [rows]);
        row r's last turn is columns start[r]:t[r]."""
        s = self.session
        with jax.transfer_guard("allow"):
            out = jax.device_get((s.tokens, s.logprobs, s.start, s.t))
        return tuple(np.asarray(x)[:self.rows] for x in out)

    def resume(self, new: dict[int, tuple[int, list[int]]], seeds: dict[int, int]) -> None:
        """Decodes the next turn of the rows in `new`: row r's entry (at, tokens) are the tokens
        from response column `at` on that its cache lacks (its turn's last token, then the
        tool's result); `seeds[r]` keys its turn. Only these rows are computed (padded to a
        power of two, at least MIN_ROWS, and to the data-parallel size); the others stay as
        they are."""
        total = self.session.t.shape[0]
        width = self.width
        dp = self.engine.sampler._dp
        order = sorted(new)
        # At least MIN_ROWS rows: a few shapes to compile, at the price of padding rows.
        count = min(-(-bucket_size(len(order), MIN_ROWS) // dp) * dp, total)
        longest = max(len(toks) for _, toks in new.values())
        chunk = min(bucket_size(longest, MIN_CHUNK), width)
        rows = np.full((count,), order[0], np.int32)
        go = np.zeros((count,), bool)
        window = np.full((count, chunk), self.engine.sampler.pad_id, np.int32)
        mask = np.zeros((count, chunk), bool)
        at = np.zeros((count,), np.int32)
        pick = np.zeros((count,), np.int32)
        turn_seeds = np.zeros((count,), np.uint32)
        for k, r in enumerate(order):
            col, toks = new[r]
            m = len(toks)
            if col < 0 or m < 1 or col + m >= width:
                raise ValueError(f"row {r}: {m} new tokens from response column {col} do not "
                                 f"fit its {width} columns")
            at[k] = min(col, width - chunk)  # a window past the cache's end moves back
            d = col - at[k]
            window[k, d:d + m], mask[k, d:d + m], pick[k] = toks, True, d + m - 1
            rows[k], go[k], turn_seeds[k] = r, True, seeds[r] & 0xFFFFFFFF
            self.prefilled += m
        for k in range(len(order), count):  # padding entries: a real row, computed, dropped
            window[k], at[k], pick[k] = window[0], at[0], pick[0]
        (rows, go, window, at, mask, pick, turn_seeds), _ = self.engine._put(
            (rows, go, window, at, mask, pick, turn_seeds), ())
        program = self.engine._program("resume", self.static, (chunk, count))
        self.session = program(self.state, self.session, rows, go, window, at, mask, pick,
                               turn_seeds, self.knobs, self.stops)

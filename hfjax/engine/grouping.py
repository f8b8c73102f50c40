"""Length-grouped micro-batches: padded rows, each micro-batch only as wide as its sequences.

A padded batch holds every sequence in P + R columns (the prompt left-padded to P, the
response right-padded to R), and a micro-batch of it costs P + R columns per row however short
its sequences are. In an RL batch a few responses run to the cap while most stop early, and the
prompts' bucket is wider than most prompts. Grouping sorts a mini-batch's rows by response
length, cuts them into micro-batches of the configured row count, and gives each micro-batch
only the columns it needs (`Cut`): the last p columns of the prompt block, p the mini-batch's
longest prompt rounded up to 16, 24, 32, 48, 64, 96, 128, 192, 256, ... (the sampler's prompt
buckets, `prompt_bucket`), and the first r of the response block, r the micro-batch's longest
response rounded up to a power of two. One prompt width per mini-batch and power-of-two
response widths keep the shapes to a handful per run: each is compiled once.

The cut rows keep the padded layout, so the loss and scoring functions run on them unchanged;
positions come from the attention mask and cut columns are padding in every row of the
micro-batch, so log-probs, values, losses and gradients equal the full-width ones up to float
rounding (the sums go in another order). A mini-batch's loss normalisers are taken over the
whole mini-batch before it is cut, as in the strided split (`hfjax.engine.update`).

With shared-prompt rows (`actor.share_prompt`, rows in groups of a prompt's samples), cuts
take whole groups, ordered by their response tokens, and a cut whose groups split over the
data-parallel devices is laid out as compact shared-prompt rows
(`hfjax.engine.shared_prompt.compact_layout`): each group's prompt once, then its responses
end to end, each only as long as it is, the rows as wide as the cut's fullest group. Its
per-response-token arrays keep the batch's response width (cheap, and one shape fewer), so
a cut's program varies with its prompt and compact widths only.

The grouping is decided on the host from the sequences' lengths (one [2, B] int fetch per
batch), and each distinct micro-batch shape is its own compiled program: where the packed
layout (`hfjax.engine.packing`) keeps one program whatever the lengths, grouping keeps dense
causal attention on narrower rows. The dry run (`hfjax.run.dry_run`) sizes a full-width
micro-batch's programs, whose memory bounds every cut's.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from hfjax.engine import shared_prompt
from hfjax.engine.buckets import bucket_size, prompt_bucket

# The narrowest prompt or response block a micro-batch is cut to.
MIN_WIDTH = 16


@dataclasses.dataclass(frozen=True)
class Cut:
    """One micro-batch: which rows of the batch, and how many prompt and response columns."""

    rows: np.ndarray  # int32 [micro], indices into the batch
    prompt: int  # the last `prompt` columns of the prompt block
    response: int  # the first `response` columns of the response block
    # Compact shared-prompt rows (`shared_prompt.compact_layout`) of the cut's groups, or None
    compact: dict[str, np.ndarray] | None = None


@functools.partial(jax.jit, static_argnums=1)
def _extents(attention_mask: jax.Array, response_len: int) -> jax.Array:
    """[2, B]: each row's prompt extent (columns from its first real prompt token to the end of
    the prompt block) and response extent (to its last real response token)."""
    real = attention_mask > 0
    prompt, response = real[:, :-response_len], real[:, -response_len:]
    p_cols, r_cols = prompt.shape[1], response.shape[1]
    p_ext = jnp.where(prompt.any(axis=1), p_cols - jnp.argmax(prompt, axis=1), 0)
    r_ext = jnp.where(response.any(axis=1), r_cols - jnp.argmax(response[:, ::-1], axis=1), 0)
    return jnp.stack([p_ext, r_ext]).astype(jnp.int32)


def extents(attention_mask: jax.Array, response_len: int) -> np.ndarray:
    """The rows' prompt and response extents [2, B] on the host (see `_extents`)."""
    with jax.transfer_guard("allow"):
        return np.asarray(jax.device_get(_extents(attention_mask, response_len)))


def plan(ext: np.ndarray, micro: int, prompt_cols: int, response_cols: int,
         dp: int = 1, group: int = 1) -> list[Cut]:
    """Cuts of `micro` rows (the last one holds what is left), longest responses first.

    `ext` is [2, B] (`extents`). Every cut keeps the mini-batch's longest prompt extent (at
    least the one column that predicts the first response token) rounded up to a prompt bucket
    (`prompt_bucket`), and its own rows' longest response rounded up to a power of two (at
    least MIN_WIDTH). `micro` is rounded up to a multiple of `dp` so that every cut of a batch
    whose size `dp` divides splits over the data-parallel devices. `group` > 1: the rows come
    in groups of that many consecutive rows (a prompt's samples, `hfjax.engine.shared_prompt`)
    and every cut takes whole groups, ordered by their response tokens; a cut whose groups
    split over the `dp` devices is computed as compact shared-prompt rows
    (`shared_prompt.compact_layout`, its response width the batch's) where they are narrow
    enough to pay (`shared_prompt.compact_pays`), any other as rows cut to its longest
    response (shared-prompt rows where its groups split over the devices, else padded)."""
    n = ext.shape[1]
    if micro <= 0:
        raise ValueError(f"micro-batches of {micro} rows: need at least one row")
    if n % group or micro % group:
        raise ValueError(f"micro-batches of {micro} rows of a batch of {n} can't take whole "
                         f"groups of {group} rows")
    unit = group * dp // math.gcd(group, dp)
    micro = -(-micro // unit) * unit
    p = prompt_bucket(int(ext[0].max(initial=0)), MIN_WIDTH, prompt_cols)
    per_group = ext[1].reshape(-1, group)
    size = per_group.sum(axis=1) if group > 1 else per_group.max(axis=1)
    groups = np.argsort(-size, kind="stable")  # longest responses (most tokens) first
    order = (groups[:, None] * group + np.arange(group)).reshape(-1)
    cuts = []
    for start in range(0, n, micro):
        rows = np.sort(order[start : start + micro]).astype(np.int32)
        r = bucket_size(int(ext[1, rows].max()), MIN_WIDTH, response_cols)
        if shared_prompt.fits(len(rows), group, dp):
            def bucket(k):
                return prompt_bucket(k, MIN_WIDTH, group * response_cols)

            _, width = shared_prompt.compact_width(ext[:, rows], group, p, response_cols, bucket)
            if shared_prompt.compact_pays(width, group, p, r):
                layout = shared_prompt.compact_layout(ext[:, rows], group, p, response_cols,
                                                      bucket)
                cuts.append(Cut(rows, p, response_cols, layout))
                continue
        cuts.append(Cut(rows, p, r))  # shared rows (where they fit) cut to the longest response
    return cuts


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _cut(arrays: dict[str, jax.Array], rows: jax.Array, response_len: int, prompt: int,
         response: int) -> dict[str, jax.Array]:
    width = arrays["input_ids"].shape[1]
    start, stop = width - response_len - prompt, width - response_len + response

    def one(key, x):
        x = jnp.take(x, rows, axis=0)
        if key in ("input_ids", "attention_mask"):
            return x[:, start:stop]
        if x.ndim >= 2 and x.shape[1] == response_len:  # per response token
            return x[:, :response]
        return x

    return {k: one(k, v) for k, v in arrays.items()}


def _device_rows(c: Cut) -> jax.Array:
    with jax.transfer_guard("allow"):  # the cut's row indices, a deliberate upload
        return jnp.asarray(c.rows)


def cut(arrays: dict[str, jax.Array], c: Cut, response_len: int,
        rows: jax.Array | None = None) -> dict[str, jax.Array]:
    """The micro-batch `c` of a padded batch: its rows, the sequences' columns cut to the
    prompt and response widths and every per-response-token array [B, R] to the response
    width; other arrays lose only their other rows. `rows`: `c.rows` already on the device."""
    rows = _device_rows(c) if rows is None else rows
    out = _cut(arrays, rows, response_len, c.prompt, c.response)
    if c.compact is not None:
        with jax.transfer_guard("allow"):  # the cut's layout, a deliberate upload
            out.update({k: jnp.asarray(v) for k, v in c.compact.items()})
    return out


@functools.partial(jax.jit, donate_argnums=0)
def _put(out: jax.Array, rows: jax.Array, values: jax.Array) -> jax.Array:
    return out.at[rows, : values.shape[1]].set(values.astype(out.dtype))


def scored(fn: Callable[[dict[str, jax.Array]], tuple[jax.Array, ...]],
           arrays: dict[str, jax.Array], cuts: list[Cut], response_len: int,
           place: Callable[[dict[str, jax.Array]], dict[str, jax.Array]] = lambda a: a,
           ) -> tuple[jax.Array, ...]:
    """`fn(micro_batch) -> per-response-token arrays [micro, r]` over the cuts, put back into
    [B, R] arrays in the batch's row order (0 past each cut's width). `place` puts a cut
    micro-batch on the group's mesh (its rows split over the data-parallel devices)."""
    outs = None
    for c in cuts:
        rows = _device_rows(c)
        values = fn(place(cut(arrays, c, response_len, rows)))
        if outs is None:
            # Laid out as the batch's rows are (`place`'s mesh).
            outs = [jnp.zeros_like(arrays["responses"], v.dtype) for v in values]
        outs = [_put(o, rows, v) for o, v in zip(outs, values, strict=True)]
    return tuple(outs)

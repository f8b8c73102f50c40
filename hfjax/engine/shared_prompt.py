"""Shared-prompt rows: the n samples of a prompt scored and trained in one row that holds the
prompt once.

In GRPO-style batches every prompt comes with n sampled responses, rows b*n .. b*n+n-1 of the
batch (the order `ActorRollout.generate` returns and the group-relative advantages assume). A
padded batch repeats the prompt in each of those rows, and every forward and backward pass
computes its tokens n times over: with gsm-style prompts of 100-180 tokens and responses that
shrink to a few dozen as training goes, most of a pass's tokens are those copies.

Here a group of n rows [P + R] becomes one row [P + n*R]: the prompt block (left-padded, as in
the padded rows), then each response block in turn. A prompt token attends to the prompt, a
response token to the whole prompt and to its own response's earlier tokens
(`hfjax.models.attention.shared_prompt_attention`), at the positions its padded row gives it.
So each response token sees the same keys at the same RoPE positions as in its padded row, and
its log-prob and gradient are the padded ones up to float rounding; the prompt's projections,
MLPs and their gradients are computed once per group instead of n times. The logits that
predict each response's first token come from the prompt's last position, shared by the group.

Micro-batches take whole groups (`update.strided_micro_batches(..., group=n)`), and a
micro-batch uses shared rows only when its groups split evenly over the data-parallel devices
(`fits`); otherwise its rows are scored as padded rows, with the same results.

**Compact rows** (`compact_layout`, with length-grouped micro-batches: `group_by_length`). A
shared row gives every response a block of the batch's response width, and in an RL batch one
capped response sets that width for the many that stopped early. A compact row lays the
group's responses end to end instead, each only as long as it is: [prompt | r1 | r2 | ... |
padding], the row as wide as its group's real response tokens (rounded up to a bucket). Which
block each column belongs to (`response_blocks`) confines attention as in a shared row; the
LM head runs on the row's response tokens only. The layout is planned on the host from the
rows' lengths (`hfjax.engine.grouping` fetches them once per batch) and the rows are gathered
on the device; log-probs go back to the padded [B, R] layout for the unchanged loss functions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from hfjax.models import moe, transformer
from hfjax.models.attention import ResponseBlocks, SharedPrompt
from hfjax.parallel import sharding as shd


def samples_per_row(samples: int, micro_rows: int, *, share: bool, packed: bool) -> int:
    """The samples a shared-prompt row holds with `samples` (`rollout.n`) per prompt and
    micro-batches of `micro_rows` sequences (`actor.ppo_micro_batch_size`): `samples` when
    `share` (`actor.share_prompt`) is on and the micro-batches hold whole groups, else 1
    (padded rows). Packed batches (`packed`: `use_remove_padding`) have their own layout and
    never share."""
    if not share or packed:
        return 1
    return samples if samples > 1 and micro_rows % samples == 0 else 1


def fits(rows: int, samples: int, dp: int = 1) -> bool:
    """Whether `rows` padded rows in groups of `samples` make shared rows that split over `dp`
    data-parallel devices (and whether sharing saves anything: `samples` > 1)."""
    return samples > 1 and rows % samples == 0 and (rows // samples) % dp == 0


def group_rows(input_ids: jax.Array, attention_mask: jax.Array, response_len: int,
               samples: int) -> tuple[jax.Array, jax.Array, jax.Array, SharedPrompt]:
    """Shared rows of a padded batch [B, P + R] whose rows come in groups of `samples` with one
    prompt: (ids, attention mask, positions) [B / samples, P + samples * R] and the layout.

    The prompt block is taken from each group's first row; responses keep their padded
    positions (the prompt's real length + t)."""
    p, r = input_ids.shape[1] - response_len, response_len
    ids = shared_rows(input_ids, response_len, samples)
    mask = shared_rows(attention_mask, response_len, samples)
    prompt_mask = mask[:, :p].astype(jnp.int32)
    prompt_pos = transformer.positions_from_mask(prompt_mask)
    real = jnp.sum(prompt_mask, axis=1)
    response_pos = real[:, None] + jnp.tile(jnp.arange(r, dtype=jnp.int32), samples)[None]
    positions = jnp.concatenate([prompt_pos, response_pos], axis=1)
    layout = SharedPrompt(p, samples)
    return (shd.constrain(ids, ("batch", None)), shd.constrain(mask, ("batch", None)),
            shd.constrain(positions, ("batch", None)), layout)


def shared_rows(x: jax.Array, response_len: int, samples: int) -> jax.Array:
    """x [B, P + R, ...] as shared rows [B / samples, P + samples * R, ...]: each group's
    first prompt block, then its rows' responses in order."""
    b, width = x.shape[:2]
    p, g = width - response_len, b // samples
    responses = x[:, p:].reshape(g, samples * response_len, *x.shape[2:])
    return jnp.concatenate([x[::samples, :p], responses], axis=1)


def predicting(hidden: jax.Array, layout: SharedPrompt) -> jax.Array:
    """hidden [G, P + n*R, D] -> [G * n, R, D]: for each response token, the hidden state of
    the position that predicts it (the prompt's last position for the first token, the
    response's previous token for the others), in the padded rows' order."""
    g, width, d = hidden.shape
    p, n = layout
    r = (width - p) // n
    last = jnp.broadcast_to(hidden[:, p - 1 : p, None], (g, n, 1, d))
    responses = hidden[:, p:].reshape(g, n, r, d)[:, :, : r - 1]
    return jnp.concatenate([last, responses], axis=2).reshape(g * n, r, d)


def response_hidden(backbone, input_ids: jax.Array, attention_mask: jax.Array,
                    response_len: int, samples: int) -> jax.Array:
    """`backbone` (a model's `Backbone`) on the shared rows of a padded batch: the hidden
    states [B, R, D] that predict each response token, as the padded rows'
    `hidden[:, P - 1 : P + R - 1]` (see `group_rows`)."""
    ids, mask, positions, layout = group_rows(input_ids, attention_mask, response_len, samples)
    # A mixture of experts' recorded routing (`moe.given_routing`) follows the rows.
    with moe.regrouped(lambda x: shared_rows(x, response_len, samples)):
        hidden, _ = backbone(ids, mask, positions=positions, shared_prompt=layout)
    return shd.constrain(predicting(hidden, layout), ("batch", None, None))


# --------------------------------------------------------------------------------------------
# Compact rows: each response only as long as it is
# --------------------------------------------------------------------------------------------

# The micro-batch entries of a compact layout (`compact_layout`), each with one leading row per
# sequence: a group's [T] (or [S]) arrays are split over its n rows, in order, so that the
# entries share the batch's leading axis and its split over the data-parallel devices.
COMPACT_KEYS = ("compact_src", "compact_blocks", "compact_positions", "compact_pred",
                "compact_slot")


def compact_width(ext: np.ndarray, samples: int, prompt: int, response: int,
                  bucket) -> tuple[int, int]:
    """(S, T): the response columns and the whole width of the compact rows that
    `compact_layout` makes of the same arguments."""
    n = samples
    lengths = np.minimum(ext[1], response).reshape(-1, n)
    s = bucket(int(lengths.sum(axis=1).max(initial=0)))
    s = -(-max(s, 1) // n) * n
    return s, -(-(prompt + s) // n) * n


def compact_layout(ext: np.ndarray, samples: int, prompt: int, response: int,
                   bucket) -> dict[str, np.ndarray]:
    """The compact rows of a micro-batch of padded rows [B, prompt + response] in groups of
    `samples` (host arrays, see `COMPACT_KEYS`).

    `ext` [2, B] holds each row's prompt and response lengths (`grouping.extents`);
    `bucket(n)` rounds a group's response tokens up to the rows' width S. A row is
    T = prompt + S columns (both rounded up to a multiple of `samples`):
    - `compact_src`: the column of the group's n padded rows, flattened [n * (P + R)], that
      each compact column takes its token from;
    - `compact_blocks`: -1 padding, 0 prompt, k the k-th response (`Backbone`'s
      `response_blocks`); `compact_positions`: the positions of the padded rows;
    - `compact_pred` [S]: the column whose hidden state predicts the response token at
      compact column prompt + s (the prompt's last for a response's first token);
    - `compact_slot` [B, R]: where response token t of each padded row sits among the S.
    """
    b, n = ext.shape[1], samples
    g, width = b // n, prompt + response
    lengths = np.minimum(ext[1], response).reshape(g, n)
    s, t = compact_width(ext, samples, prompt, response, bucket)
    src = np.zeros((g, t), np.int32)
    blocks = np.full((g, t), -1, np.int32)
    pos = np.zeros((g, t), np.int32)
    pred = np.zeros((g, s), np.int32)
    slot = np.zeros((b, response), np.int32)
    for gi in range(g):
        pl = int(min(ext[0, gi * n], prompt))
        cols = np.arange(prompt - pl, prompt)
        src[gi, cols], blocks[gi, cols], pos[gi, cols] = cols, 0, np.arange(pl)
        off = prompt
        for i in range(n):
            ln = int(lengths[gi, i])
            steps = np.arange(ln)
            cols = off + steps
            src[gi, cols] = i * width + prompt + steps
            blocks[gi, cols], pos[gi, cols] = i + 1, pl + steps
            pred[gi, cols - prompt] = np.where(steps == 0, prompt - 1, cols - 1)
            slot[gi * n + i, :ln] = cols - prompt
            off += ln
    return {"compact_src": src.reshape(b, t // n), "compact_blocks": blocks.reshape(b, t // n),
            "compact_positions": pos.reshape(b, t // n), "compact_pred": pred.reshape(b, s // n),
            "compact_slot": slot}


# Compact rows are used where they are at most this fraction of the width of shared rows
# whose response blocks are the cut's longest response wide. Past it, most of a group's
# responses are long and shared rows' fixed blocks are the faster layout on the CPU (the
# untuned SmolLM2's gsm_symbolic mix, half its responses at the cap: docs/benchmarks.md,
# "Compact shared-prompt rows").
COMPACT_MAX_FRACTION = 2 / 3


def compact_pays(width: int, samples: int, prompt: int, response: int) -> bool:
    """Whether compact rows `width` columns wide (`compact_width`'s T) are narrow enough to
    beat shared rows with response blocks `response` columns wide (`COMPACT_MAX_FRACTION`)."""
    return width <= COMPACT_MAX_FRACTION * (prompt + samples * response)


def is_compact(mb: dict[str, jax.Array]) -> bool:
    """Whether a micro-batch carries a compact layout (`compact_layout`)."""
    return "compact_src" in mb


def _groups(x: jax.Array, samples: int) -> jax.Array:
    """[B, K] split over each group's rows -> the group's [G, n * K] array."""
    b, k = x.shape
    return shd.constrain(x.reshape(b // samples, samples * k), ("batch", None))


def compact_hidden(backbone, mb: dict[str, jax.Array], samples: int, **kw):
    """`backbone` on the compact rows of micro-batch `mb` (`kw` to it): (hidden states
    [G, T, D], the rows' tokens [G, T], the column predicting each response column [G, S],
    the prompt's width P)."""
    ids = _groups(mb["input_ids"], samples)  # [G, n * (P + R)]
    src = _groups(mb["compact_src"], samples)
    rows = jnp.take_along_axis(ids, src, axis=1)  # [G, T]
    r = mb["responses"].shape[1]
    p = mb["input_ids"].shape[1] - r
    # No response is longer than the batch's response width: attention's band.
    blocks = ResponseBlocks(_groups(mb["compact_blocks"], samples), p, r)
    hidden, _ = backbone(rows, None, positions=_groups(mb["compact_positions"], samples),
                         response_blocks=blocks, **kw)
    return hidden, rows, _groups(mb["compact_pred"], samples), p


def compact_response_hidden(backbone, mb: dict[str, jax.Array], samples: int,
                            ) -> tuple[jax.Array, jax.Array]:
    """`backbone` on the compact rows of micro-batch `mb`: (the hidden states [G, S, D] that
    predict each response token of the rows, their labels [G, S])."""
    hidden, rows, pred, p = compact_hidden(backbone, mb, samples)
    labels = rows[:, p : p + pred.shape[1]]
    return jnp.take_along_axis(hidden, pred[:, :, None], axis=1), labels


def compact_to_rows(values: jax.Array, mb: dict[str, jax.Array], samples: int) -> jax.Array:
    """values [G, S] of compact rows -> [B, R] at each padded row's response tokens (0 past
    its length)."""
    g, s = values.shape
    slot = mb["compact_slot"]
    b, r = slot.shape
    per_group = jnp.take_along_axis(values, slot.reshape(g, samples * r), axis=1)
    real = mb["attention_mask"][:, -r:] > 0
    return jnp.where(real, per_group.reshape(b, r), 0)

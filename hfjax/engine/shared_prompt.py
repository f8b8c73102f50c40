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
(`hfjax.models.transformer.shared_prompt_attention`), at the positions its padded row gives it.
So each response token sees the same keys at the same RoPE positions as in its padded row, and
its log-prob and gradient are the padded ones up to float rounding; the prompt's projections,
MLPs and their gradients are computed once per group instead of n times. The logits that
predict each response's first token come from the prompt's last position, shared by the group.

Micro-batches take whole groups (`update.strided_micro_batches(..., group=n)`, the grouped
layout's cuts likewise), and a micro-batch uses shared rows only when its groups split evenly
over the data-parallel devices (`fits`); otherwise its rows are scored as padded rows, with
the same results.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hfjax.models import transformer
from hfjax.models.transformer import SharedPrompt
from hfjax.parallel import sharding as shd


def samples_per_row(section, samples: int) -> int:
    """The samples a shared-prompt row holds for a policy config section (`actor`) and
    `rollout.n` = `samples`: `samples` when `share_prompt` is on and the micro-batches
    (`ppo_micro_batch_size`) hold whole groups, else 1 (padded rows). Packed batches
    (`use_remove_padding`) have their own layout and never share."""
    if not section.get("share_prompt", False) or section.get("use_remove_padding", False):
        return 1
    micro = int(section.get("ppo_micro_batch_size", 0))
    return samples if samples > 1 and micro % samples == 0 else 1


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
    b, width = input_ids.shape
    p, r, g = width - response_len, response_len, b // samples

    def rows(x):  # [B, P + R] -> [G, P + n*R]
        return jnp.concatenate([x[::samples, :p], x[:, p:].reshape(g, samples * r)], axis=1)

    ids, mask = rows(input_ids), rows(attention_mask)
    prompt_mask = mask[:, :p].astype(jnp.int32)
    prompt_pos = transformer.positions_from_mask(prompt_mask)
    real = jnp.sum(prompt_mask, axis=1)
    response_pos = real[:, None] + jnp.tile(jnp.arange(r, dtype=jnp.int32), samples)[None]
    positions = jnp.concatenate([prompt_pos, response_pos], axis=1)
    layout = SharedPrompt(p, samples)
    return (shd.constrain(ids, ("batch", None)), shd.constrain(mask, ("batch", None)),
            shd.constrain(positions, ("batch", None)), layout)


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
    hidden, _ = backbone(ids, mask, positions=positions, shared_prompt=layout)
    return shd.constrain(predicting(hidden, layout), ("batch", None, None))

"""A rollout's responses as a batch's columns: the padding columns cut (`trim`), prompts
joined with responses (`join`), the rows cut off at the length limit (`truncated`), and the
response mask with rejected tokens taken out (`keep_tokens`, which the actor's and the critic's
losses both apply).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hfjax.engine import token_select
from hfjax.engine.buckets import MIN_NEW_TOKENS_BUCKET, bucket_size
from hfjax.engine.sampler import GenerateOutput
from hfjax.parallel.transfer import to_host


def trim(out: GenerateOutput) -> GenerateOutput:
    """Cuts the response columns that are padding in every row, keeping a power-of-two width
    (at least MIN_NEW_TOKENS_BUCKET) so that a run compiles a handful of shapes.

    Reads the longest response length from the devices (one scalar, after generation has
    finished anyway) unless the width is already the smallest bucket.
    """
    rows, width = out.tokens.shape
    if width <= MIN_NEW_TOKENS_BUCKET:  # nothing to cut: skip the fetch
        return out
    with jax.transfer_guard("allow"):
        longest = int(to_host(jnp.max(jnp.sum(out.mask, axis=1))))
    keep = bucket_size(longest, MIN_NEW_TOKENS_BUCKET, cap=width)
    return out if keep == width else out.head(rows, keep)


# Which rows ran to the length limit without a stop token (verl's response_length/clip_ratio).
truncated = jax.jit(token_select.truncated, static_argnums=(2, 3))


@jax.jit
def keep_tokens(mask, keep):
    """`mask` with the tokens `keep` rejects zeroed (rollout rejection's mask), in its dtype."""
    return (mask * keep.astype(mask.dtype)).astype(mask.dtype)


@jax.jit
def join(prompts, pmask, resp, rmask) -> dict:
    """The batch's response and whole-sequence columns from prompts and responses."""
    return {
        "responses": resp,
        "response_mask": rmask,
        "input_ids": jnp.concatenate([prompts, resp], axis=1),
        "attention_mask": jnp.concatenate([pmask, rmask], axis=1),
    }

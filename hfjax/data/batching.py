"""Host batches from dataset rows: padded token arrays for prompts (left-padded, as the sampler
needs) and for supervised (prompt, response) pairs."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from hfjax.controller.batch import Batch
from hfjax.data.dataset import reward_meta
from hfjax.engine.buckets import prompt_bucket


def left_pad(seqs: Sequence[Sequence[int]], width: int, pad_id: int
             ) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask) int32 [N, width], each sequence right-aligned; ValueError if one is longer."""
    ids = np.full((len(seqs), width), pad_id, np.int32)
    mask = np.zeros((len(seqs), width), np.int32)
    for i, s in enumerate(seqs):
        if len(s) > width:
            raise ValueError(f"sequence {i} has {len(s)} tokens, more than the limit {width}")
        if len(s):
            ids[i, width - len(s) :] = s
            mask[i, width - len(s) :] = 1
    return ids, mask


def right_pad(seqs: Sequence[Sequence[int]], width: int, pad_id: int
              ) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask) int32 [N, width], each sequence left-aligned and cut at width."""
    ids = np.full((len(seqs), width), pad_id, np.int32)
    mask = np.zeros((len(seqs), width), np.int32)
    for i, s in enumerate(seqs):
        s = list(s)[:width]
        ids[i, : len(s)] = s
        mask[i, : len(s)] = 1
    return ids, mask


def prompt_batch(rows: Sequence[dict], seeds: np.ndarray, pad_id: int,
                 max_prompt_length: int) -> Batch:
    """Host batch of left-padded prompts (`prompts`, `prompt_mask`), per-row `seeds`, and the
    rows' reward metadata.

    The width is the longest prompt's length rounded up to the sampler's prompt bucket (16, 24,
    32, 48, ...: `prompt_bucket`), capped at max_prompt_length: no stage computes on columns
    that are padding in every row, and a run compiles a handful of widths.
    """
    ids_list = [r["prompt_ids"] for r in rows]
    width = prompt_bucket(max(len(i) for i in ids_list), cap=max_prompt_length)
    ids, mask = left_pad(ids_list, width, pad_id)
    return Batch({"prompts": ids, "prompt_mask": mask, "seeds": seeds.astype(np.int32)},
                 meta=reward_meta(rows))


def sft_arrays(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], *,
               prompt_width: int, response_width: int, pad_id: int,
               loss_masks: Sequence[Sequence[int]] | None = None) -> Batch:
    """One host batch of every (prompt, response) pair: `input_ids`/`attention_mask` (prompt
    left-padded to `prompt_width`, then the response right-padded to `response_width`), and
    `responses`/`response_mask`, the tokens a supervised loss is taken on (all response tokens,
    or those whose `loss_masks` flag is 1)."""
    pid, pm = left_pad(prompts, prompt_width, pad_id)
    rid, rm = right_pad(responses, response_width, pad_id)
    loss = rm if loss_masks is None else right_pad(loss_masks, response_width, 0)[0]
    return Batch({
        "input_ids": np.concatenate([pid, rid], 1),
        "attention_mask": np.concatenate([pm, rm], 1),
        "responses": rid,
        "response_mask": loss,
    })


def sft_batches(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], *,
                prompt_width: int, response_width: int, pad_id: int, batch_size: int,
                steps: int, seed: int,
                loss_masks: Sequence[Sequence[int]] | None = None) -> Iterator[Batch]:
    """`steps` host batches of `batch_size` (prompt, response) token pairs drawn without
    replacement within a batch, laid out as `sft_arrays` does."""
    if batch_size > len(prompts):
        raise ValueError(f"an SFT batch of {batch_size} needs at least that many examples, "
                         f"there are {len(prompts)}; lower the batch size or add data")
    every = sft_arrays(prompts, responses, prompt_width=prompt_width,
                       response_width=response_width, pad_id=pad_id, loss_masks=loss_masks)
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        idx = rng.choice(len(prompts), batch_size, replace=False)
        yield Batch({k: v[idx] for k, v in every.arrays.items()})

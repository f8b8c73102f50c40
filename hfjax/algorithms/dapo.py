"""DAPO: GRPO's dataflow with
- clip-higher: an asymmetric PPO clip (actor.clip_ratio_low 0.2, clip_ratio_high 0.28);
- dynamic sampling: groups whose samples all score the same (zero advantage) are dropped, and
  more prompts are generated until the batch holds `data.train_batch_size` groups, at most
  `algo.filter_groups.max_num_gen_batches` generation batches per step (0: no cap);
- a token-level loss (actor.loss_agg_mode="token-mean");
- overlong reward shaping: responses longer than rollout.response_length minus
  `algo.overlong_buffer.len` lose up to `penalty_factor`, linearly (hfjax.numerics.shaping);
- no KL term (no reference model).

When the cap is reached before the batch is full, `algo.filter_groups.on_exhausted` decides:
"error" stops the run with a message saying what to change; "fill" completes the batch with
the most recently dropped groups (their advantages are 0, so they add no gradient, only
weight in the token mean) and counts them in `dapo/filled_groups`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from hfjax.algorithms.dataflow import compute_advantage, log_probs, reward
from hfjax.algorithms.registry import all_of, register_algorithm, requires
from hfjax.algorithms.spec import StepSpec
from hfjax.controller.batch import Batch
from hfjax.numerics import shaping
from hfjax.workers.groups import WorkerGroups

ON_EXHAUSTED = ("error", "fill")


class DynamicSamplingExhausted(RuntimeError):
    """Dynamic sampling could not fill the batch within its cap of generation batches."""


def _check(cfg) -> None:
    a = cfg.actor
    if a.use_kl_loss or cfg.algo.use_kl_in_reward:
        raise ValueError("algorithm 'dapo' trains without a KL term; set "
                         "--config.actor.use_kl_loss=False and --config.algo.use_kl_in_reward="
                         "False (configs/dapo_arith.py does)")
    f = cfg.algo.filter_groups
    if f.on_exhausted not in ON_EXHAUSTED:
        raise ValueError(f"algo.filter_groups.on_exhausted={f.on_exhausted!r}; use one of "
                         f"{', '.join(ON_EXHAUSTED)}")
    if f.max_num_gen_batches < 0:
        raise ValueError(f"algo.filter_groups.max_num_gen_batches={f.max_num_gen_batches}; use "
                         "a positive cap, or 0 for none")
    o = cfg.algo.overlong_buffer
    if o.enable and not 0 < o.len <= cfg.rollout.response_length:
        raise ValueError(f"algo.overlong_buffer.len={o.len} must lie in [1, "
                         f"rollout.response_length={cfg.rollout.response_length}]")


@register_algorithm("dapo", roles=("actor", "reward"), check=all_of(
    _check, requires("dapo", algo__adv_estimator="grpo", actor__loss_agg_mode="token-mean")))
def dapo_step(w: WorkerGroups, batch: Batch, spec: StepSpec) -> tuple[Batch, dict]:
    batch, metrics = sample_varied_groups(w, batch, spec)
    batch = log_probs(w, batch, spec)
    batch, adv_metrics = w.run("adv", compute_advantage, batch, spec, w.kl_ctrl.value)
    metrics |= adv_metrics
    metrics |= w.run("update_actor", w.actor.update_actor, batch)
    return batch, metrics


def sample_varied_groups(w: WorkerGroups, prompts: Batch,
                         spec: StepSpec) -> tuple[Batch, dict]:
    """Generates, scores and shapes groups of `rollout.n` samples until `len(prompts)` groups
    with differing scores are in hand (dynamic sampling), drawing further prompt batches from
    `w.next_prompts`. Returns the batch of kept groups and dapo/ metrics."""
    f, n, want = spec.algo.filter_groups, spec.rollout.n, len(prompts)
    kept: list[Batch] = []
    dropped: list[Batch] = []
    have = tries = 0
    while True:
        tries += 1
        gen = w.run("gen", w.actor.generate, prompts)
        gen = shape_overlong(reward(w, gen, spec), spec)
        if not f.enable:
            return gen, {}
        keep = w.run("filter", varied_group_mask, gen, n)
        groups = keep.reshape(-1, n)[:, 0]
        take = min(int(groups.sum()), want - have)
        chosen = np.flatnonzero(groups)[:take]
        kept.append(gen.take(_rows(chosen, n)))
        dropped.append(gen.take(_rows(np.flatnonzero(~groups), n)))
        have += take
        if have == want:
            break
        if f.max_num_gen_batches and tries >= f.max_num_gen_batches:
            if f.on_exhausted == "error":
                raise DynamicSamplingExhausted(
                    f"DAPO dynamic sampling kept {have} of {want} groups with differing scores "
                    f"after {tries} generation batches (algo.filter_groups.max_num_gen_batches"
                    f"={f.max_num_gen_batches}); raise the cap (0: none), lower "
                    "data.train_batch_size, or set algo.filter_groups.on_exhausted=fill")
            break
        if w.next_prompts is None:
            raise DynamicSamplingExhausted(
                "DAPO dynamic sampling needs more prompts but the worker groups have no "
                "prompt source (WorkerGroups.next_prompts)")
        prompts = w.next_prompts(tries)
    filled = want - have
    if filled:  # on_exhausted == "fill": the most recent dropped groups complete the batch
        spare = Batch.concat(align(dropped[::-1]))
        kept.append(spare.index(slice(0, filled * n)))
    out = Batch.concat(align(kept)) if len(kept) > 1 else kept[0]
    return out, {"dapo/gen_batches": float(tries), "dapo/filled_groups": float(filled)}


def _rows(groups: np.ndarray, n: int) -> np.ndarray:
    return (groups[:, None] * n + np.arange(n)).reshape(-1)


def varied_group_mask(batch: Batch, n: int) -> np.ndarray:
    """Host bool [B]: the rows whose group of n samples has differing total scores (one small
    deliberate fetch per generation batch: the keep decision sets the batch's shape)."""
    keep = _varied(batch["token_level_scores"], n)
    with jax.transfer_guard("allow"):
        return np.asarray(jax.device_get(keep))


@functools.partial(jax.jit, static_argnums=1)
def _varied(scores: jax.Array, n: int) -> jax.Array:
    b = scores.shape[0]
    return shaping.varied_groups(jnp.sum(scores, axis=1), jnp.arange(b) // n, b // n)


def shape_overlong(batch: Batch, spec: StepSpec) -> Batch:
    """Adds DAPO's overlong penalty to each response's score (on its last token) when
    `algo.overlong_buffer.enable`; the penalties stay in the batch as `overlong_penalty`."""
    o = spec.algo.overlong_buffer
    if not o.enable:
        return batch
    scores, penalty = _overlong(batch["token_level_scores"], batch["response_mask"],
                                batch["attention_mask"], max_length=spec.rollout.response_length,
                                buffer=o.len, factor=o.penalty_factor)
    # The rule stage's scores are replaced by the shaped ones (select drops the old entry).
    rest = batch.select([k for k in batch.arrays if k != "token_level_scores"])
    return rest.union(Batch({"token_level_scores": scores, "overlong_penalty": penalty}))


@functools.partial(jax.jit, static_argnames=("max_length", "buffer", "factor"))
def _overlong(scores, mask, attention_mask, *, max_length, buffer, factor):
    # The length the budget counts: policy turns and the tool results between them.
    length = shaping.response_extent(attention_mask, mask.shape[1])
    penalty = shaping.overlong_penalty(length, max_length, buffer, factor)
    return scores + shaping.scores_on_last_token(penalty, mask), penalty


# -- batches of different widths --------------------------------------------------------------

# Arrays whose columns are prompt positions (left-padded) and whole sequences; every other
# 2-D array's columns are response positions (right-padded).
_PROMPT_SIDE = ("prompts", "prompt_mask")
_SEQUENCE = ("input_ids", "attention_mask")


def align(batches: list[Batch]) -> list[Batch]:
    """The batches with prompt-side arrays left-padded and response-side arrays right-padded
    to common widths, and input_ids / attention_mask rebuilt, so that they concatenate.
    (Each generation batch buckets its own prompt and response widths.)"""
    if len(batches) < 2:
        return batches
    p = max(b["prompts"].shape[1] for b in batches)
    r = max(b["responses"].shape[1] for b in batches)
    return [_pad_batch(b, p, r) for b in batches]


def _pad_batch(b: Batch, p: int, r: int) -> Batch:
    if b["prompts"].shape[1] == p and b["responses"].shape[1] == r:
        return b
    arrays = {}
    old_p = b["prompts"].shape[1]
    for k, x in b.arrays.items():
        if x.ndim < 2 or k in _SEQUENCE:
            arrays[k] = x
        elif k in _PROMPT_SIDE:
            arrays[k] = _pad_cols(x, p - x.shape[1], left=True)
        else:
            arrays[k] = _pad_cols(x, r - x.shape[1], left=False)
    if "input_ids" in arrays:
        arrays["input_ids"] = _join(arrays["prompts"], arrays["responses"])
        # The response half of attention_mask is padded, not rebuilt from response_mask: a
        # multi-turn row's tool results are attended to (context) but not in response_mask.
        attn = b["attention_mask"]
        arrays["attention_mask"] = _join(
            _pad_cols(attn[:, :old_p], p - old_p, left=True),
            _pad_cols(attn[:, old_p:], r - (attn.shape[1] - old_p), left=False))
    return Batch(arrays, b.meta, b.info)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _pad_cols(x: jax.Array, k: int, left: bool) -> jax.Array:
    widths = [(0, 0)] * x.ndim
    widths[1] = (k, 0) if left else (0, k)
    return jnp.pad(x, widths)


@jax.jit
def _join(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.concatenate([a, b.astype(a.dtype)], axis=1)

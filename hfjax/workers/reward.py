"""Reward workers: rule functions by data_source on the host, and a scalar-head reward model.

Rule rewards need text, so they make the one deliberate host fetch of a step: the response
tokens. The scores go back to the devices as `token_level_scores` [B, R], with each sequence's
score on its last response token, placed with the same sharding as `response_mask`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from hfjax.controller.batch import Batch
from hfjax.controller.protocol import DP_COMPUTE
from hfjax.controller.worker_group import WorkerGroup, method
from hfjax.rewards.registry import get_reward_fn


def scores_at_last_token(scores: jax.Array, response_mask: jax.Array) -> jax.Array:
    """[B] scores -> [B, R] with each score on the row's last response token (0 elsewhere)."""
    r = response_mask.shape[1]
    length = jnp.sum(response_mask > 0, axis=1)
    last = jnp.maximum(length - 1, 0)
    onehot = (jnp.arange(r)[None, :] == last[:, None]) & (length[:, None] > 0)
    return onehot.astype(jnp.float32) * scores[:, None].astype(jnp.float32)


class RuleReward:
    """Scores decoded responses with the rule function registered for each row's data_source."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.failures = 0

    def fetch_responses(self, batch: Batch) -> tuple[np.ndarray, np.ndarray]:
        """The step's deliberate host fetch: response tokens and mask."""
        with jax.transfer_guard("allow"):
            return np.asarray(batch["responses"]), np.asarray(batch["response_mask"])

    def compute_reward(self, batch: Batch) -> Batch:
        """Batch with `token_level_scores` [B, R] on the responses' devices and host `acc`."""
        tokens, mask = self.fetch_responses(batch)
        sources = batch.meta["data_source"]
        truths = batch.meta["ground_truth"]
        scores = np.zeros(len(tokens), np.float32)
        texts = []
        for i in range(len(tokens)):
            text = self.tokenizer.decode(tokens[i][mask[i] > 0].tolist())
            texts.append(text)
            try:
                fn = get_reward_fn(str(sources[i]))
                out = fn(str(sources[i]), text, str(truths[i]), None)
                scores[i] = float(out["score"] if isinstance(out, dict) else out)
            except ValueError:
                raise
            except Exception as err:  # a broken rule must not kill the run
                self.failures += 1
                logging.warning("reward for row %d raised %r; scoring it 0", i, err)
        with jax.transfer_guard("allow"):
            placed = jax.device_put(scores, _row_sharding(batch["response_mask"]))
        tls = _jit_scores(placed, batch["response_mask"])
        return Batch({"token_level_scores": tls}, meta={"response_text": texts})


_jit_scores = jax.jit(scores_at_last_token)


def _row_sharding(x: jax.Array):
    """The sharding of x's leading axis alone, for a [B] array living beside x."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    sh = x.sharding
    if isinstance(sh, NamedSharding):
        return NamedSharding(sh.mesh, P(*sh.spec[:1]))
    return sh


class ModelReward(WorkerGroup):
    """A ScoreModel on its pool: one scalar per sequence, on the last response token."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._score = jax.jit(lambda p, ids, m: self.model(p)(ids, m))

    @method(DP_COMPUTE)
    def compute_rm_score(self, batch: Batch) -> Batch:
        s = self._score(self.params, batch["input_ids"], batch["attention_mask"])
        return Batch({"rm_scores": scores_at_last_token(s, batch["response_mask"])})

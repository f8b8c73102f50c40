"""Reward and cost models as worker groups: a `ScoreModel` (one scalar per sequence, read where
transformers' `*ForSequenceClassification` reads it) on its own pool's mesh, like the critic.

In the RL dataflow a `ModelReward` scores the actor's sequences (prompt + response, as the
actor holds them) and returns one score per row under its `output` name (`rm_scores` for the
reward model, `cost_scores` for Safe-RLHF's cost model). `update_pairwise` trains it on
preference pairs with the Bradley–Terry loss (`hfjax.numerics.losses.pairwise_loss`), which is
what `launch.train_rm` runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hfjax.controller.batch import Batch
from hfjax.controller.protocol import DP_COMPUTE, method
from hfjax.engine import packing
from hfjax.models.transformer import ScoreModel, pooled_index
from hfjax.numerics import losses
from hfjax.workers.base import Program, StepShape, WorkerGroup

# A preference pair: the preferred and the other sequence, each prompt (left-padded) + response
# (right-padded), at the same width.
PAIR_KEYS = ("chosen_ids", "chosen_mask", "rejected_ids", "rejected_mask")
# Optional Safe-RLHF labels: +1 for a costly (unsafe) response, -1 for a harmless one.
SIGN_KEYS = ("chosen_sign", "rejected_sign")


def _pair_totals(batch):
    return {"pairs": jnp.float32(batch["chosen_ids"].shape[0])}


class ModelReward(WorkerGroup):
    """A ScoreModel on its pool: scores sequences, and trains on preference pairs.

    `output` names the batch array of scores [B] that `compute_score` returns; `sign_coef` and
    `center_coef` weigh the pairwise loss's cost-sign and centering terms in `update_pairwise`.
    """

    def __init__(self, name: str, pool, mesh_spec, model, *, output: str = "rm_scores",
                 sign_coef: float = 0.0, center_coef: float = 0.0,
                 budget: packing.TokenBudget | None = None, **kw):
        if not isinstance(model, ScoreModel):
            raise ValueError(f"{name}: a {type(model).__name__} has no score head; load the "
                             "checkpoint with hfjax.models.load(path, head='score')")
        super().__init__(name, pool, mesh_spec, model, **kw)
        self.output = output
        self.sign_coef = float(sign_coef)
        self.center_coef = float(center_coef)
        # Packed rows cut by a token budget (`hfjax.engine.packing`); None: padded batches.
        self.budget = budget
        self._score = self.jit(self._score_fn)
        self._packed_score = self.jit(self._packed_score_fn, static_argnums=(3,))

    def _score_fn(self, params, input_ids, attention_mask):
        return self.model(params)(input_ids, attention_mask)

    def _packed_score_fn(self, params, input_ids, attention_mask, shape):
        scores = self.model(params).token_scores
        read = pooled_index(input_ids, attention_mask, self.config.pad_token_id)
        return packing.last_tokens(lambda rows, span: packing.apply(scores, rows, span),
                                   input_ids, attention_mask, shape, read)

    @method(DP_COMPUTE, reads=("input_ids", "attention_mask"))
    def compute_score(self, batch: Batch) -> Batch:
        """Batch with the scores [B] under `self.output`, read at each row's last token that is
        not the pad (`transformer.pooled_index`)."""
        ids, mask = batch["input_ids"], batch["attention_mask"]
        if self.budget is None:
            return Batch({self.output: self._score(self.params, ids, mask)})
        shape = self.budget.shape(len(batch), ids.shape[1], self.dp_size, self.name)
        return Batch({self.output: self._packed_score(self.params, ids, mask, shape)})

    def programs(self, shape: StepShape) -> list[Program]:
        """The scoring pass over a step's sequences (`compute_score`: padded, or packed rows
        cut by the token budget). Pairwise training (`update_pairwise`) is launch.train_rm's,
        not the RL step's."""
        rows = self.padded_rows(shape.sequences)
        ids = self.abstract_rows(rows, shape.width)
        mask = self.abstract_rows(rows, shape.width)
        held, named = (f"{self.name} params",), {"params": self.params}
        if self.budget is None:
            return [Program(f"{self.name}.score", self._score, (self.params, ids, mask), held,
                            named)]
        pack = self.budget.shape(rows, shape.width, self.dp_size, self.name)
        return [Program(f"{self.name}.score", self._packed_score, (self.params, ids, mask, pack),
                        held, named)]

    def _pair_loss(self, params, mb, totals):
        n = mb["chosen_ids"].shape[0]
        # One forward pass over both halves of the pairs.
        ids = jnp.concatenate([mb["chosen_ids"], mb["rejected_ids"]])
        mask = jnp.concatenate([mb["chosen_mask"], mb["rejected_mask"]])
        scores = self.model(params)(ids, mask)
        chosen, rejected = scores[:n], scores[n:]
        loss, acc = losses.pairwise_loss(
            chosen, rejected, chosen_sign=mb.get("chosen_sign"),
            rejected_sign=mb.get("rejected_sign"), sign_coef=self.sign_coef,
            center_coef=self.center_coef)
        weight = n / totals["pairs"]  # this micro-batch's share of the mini-batch's pairs
        metrics = {"rm/accuracy": acc * weight,
                   "rm/margin": jnp.mean(chosen - rejected) * weight,
                   "rm/score_mean": jnp.mean(scores) * weight}
        return loss * weight, metrics

    @method(DP_COMPUTE, reads=PAIR_KEYS, may_read=SIGN_KEYS)
    def update_pairwise(self, batch: Batch, micro: int) -> dict[str, jax.Array]:
        """One optimizer step of the pairwise loss over the pairs of `batch`, in micro-batches
        of `micro` pairs; returns rm/loss, rm/accuracy, rm/margin, rm/grad_norm (device
        scalars)."""
        keys = list(PAIR_KEYS)
        if self.sign_coef:
            missing = [k for k in SIGN_KEYS if k not in batch]
            if missing:
                raise KeyError(f"{self.name}: sign_coef > 0 needs the pairs' {missing} labels")
            keys += list(SIGN_KEYS)
        m = self.train(self._pair_loss, batch, keys, mini=len(batch), micro=micro, epochs=1,
                       shuffle=False, normalisers=_pair_totals)
        m["rm/loss"] = m.pop("loss")
        m["rm/grad_norm"] = m.pop("grad_norm")
        return m


"""The critic worker groups: per-token values and clipped value-loss updates, of the reward
(`Critic`) or of the cost (`CostCritic`, Safe-RLHF's second critic)."""

from __future__ import annotations

import jax

from hfjax.controller.batch import Batch
from hfjax.controller.protocol import DP_COMPUTE, method
from hfjax.engine import grouping, packing
from hfjax.engine.spec import RolloutSpec
from hfjax.engine.update import ordered_after, share_of_normaliser
from hfjax.numerics import core, losses
from hfjax.workers import responses, vision
from hfjax.workers.base import SEQUENCES, Program, StepShape, WorkerGroup
from hfjax.workers.spec import CriticSpec


class Critic(WorkerGroup):
    """A ValueModel on its pool. Values of response token t are read at position P + t - 1.

    It reads and writes the batch arrays named by VALUES and RETURNS and reports metrics under
    METRICS/; `CostCritic` is the same model on the cost's arrays. `spec` holds its section's
    settings (`hfjax.workers.spec.CriticSpec`, built once from the config), `rollout` the
    actor's (`hfjax.engine.spec.RolloutSpec`): its samples per prompt and response length."""

    VALUES, RETURNS, METRICS = "values", "returns", "critic"

    def __init__(self, *args, spec: CriticSpec, rollout: RolloutSpec, **kw):
        CriticSpec.require(spec, type(self).__name__, "spec")
        RolloutSpec.require(rollout, type(self).__name__, "rollout")
        super().__init__(*args, **kw)
        self.spec = spec
        self.rollout = rollout
        # The configured response length: the fixed divisor of "seq-mean-token-sum-norm" when
        # batches are trimmed to their longest response (hfjax.workers.actor).
        self.horizon = float(rollout.response_length)
        # Packed rows cut by a token budget (`hfjax.engine.packing`); None: padded batches.
        self.budget = spec.budget
        # Padded micro-batches of similar lengths, each as wide as its rows need.
        self.grouped = spec.group_by_length
        if self.vl is not None:
            vision.check_rows(self.name, packed=self.budget is not None, grouped=self.grouped,
                              samples=1, mesh=self.mesh)
        self._values = self.jit(self._values_fn, static_argnums=(3,))
        self._packed_values = self.jit(self._packed_values_fn, static_argnums=(3, 4))

    def _values_fn(self, params, input_ids, attention_mask, response_len, images=None):
        model = self.model(params)
        with self.seeing(model, images or {}):  # the rows' images (`hfjax.workers.vision`)
            values = model(input_ids, attention_mask)
        return values[:, -response_len - 1 : -1]

    def _packed_fn(self, params):
        """(packed rows, span) -> values [G, W] under `params`."""
        model = self.model(params)
        return lambda rows, span: packing.apply(model, rows, span)

    def _packed_values_fn(self, params, input_ids, attention_mask, response_len, shape):
        return packing.forward(self._packed_fn(params), input_ids, attention_mask,
                               response_len, shape)

    @method(DP_COMPUTE, reads=SEQUENCES, may_read=vision.IMAGES)
    def compute_values(self, batch: Batch) -> Batch:
        """Batch with `values` [B, R]."""
        return self._compute_values(batch)

    def programs(self, shape: StepShape) -> list[Program]:
        """The value pass over a step's sequences (packed, a full-width length-grouped
        micro-batch, or the padded batch) and the update on a mini-batch, as
        `compute_values` and `update_critic` run them."""
        c, r = self.spec, shape.response_len
        rows = self.padded_rows(shape.sequences)
        held, named = (f"{self.name} params",), {"params": self.params}
        name = f"{self.name}.values"
        if self.grouped:
            cut = self.abstract_sequences(min(c.ppo_micro_batch_size, rows), shape)
            values = Program(name, self._values, (self.params, cut["input_ids"],
                                                  cut["attention_mask"], r), held, named)
        else:
            seqs = self.abstract_sequences(rows, shape)
            ids, mask = seqs["input_ids"], seqs["attention_mask"]
            if self.budget is not None:
                pack = self.budget.shape(rows, shape.width, self.dp_size, self.name)
                values = Program(name, self._packed_values, (self.params, ids, mask, r, pack),
                                 held, named)
            else:
                values = Program(name, self._values, (self.params, ids, mask, r), held, named)
        mini = c.ppo_mini_batch_size * self.rollout.n
        mb = self.abstract_sequences(mini, shape)
        mb |= {k: self.abstract_rows(mini, r, "float32") for k in ("values", "returns")}
        return [values, *self.update_programs("update", self._loss, mb, c.ppo_micro_batch_size,
                                              budget=self.budget, grouped=self.grouped)]

    def _compute_values(self, batch: Batch) -> Batch:
        r = batch["responses"].shape[1]
        ids, mask = batch["input_ids"], batch["attention_mask"]
        if self.grouped:
            cuts = grouping.plan(grouping.extents(mask, r), self.spec.ppo_micro_batch_size,
                                 ids.shape[1] - r, r, self.dp_size)
            (values,) = grouping.scored(
                lambda mb: (self._values(self.params, mb["input_ids"], mb["attention_mask"],
                                         mb["responses"].shape[1]),),
                dict(batch.select(SEQUENCES).arrays), cuts, r, self.on_mesh)
            return Batch({self.VALUES: values})
        if self.budget is None:
            return Batch({self.VALUES: self._values(self.params, ids, mask, r,
                                                    vision.images_of(batch.arrays))})
        shape = self.budget.shape(len(batch), ids.shape[1], self.dp_size, self.name)
        return Batch({self.VALUES: self._packed_values(self.params, ids, mask, r, shape)})

    def _loss(self, params, mb, totals):
        c = self.spec
        if "packed" in mb:
            vpreds = packing.response_values(self._packed_fn(params), mb)
        else:
            vpreds = self._values_fn(params, mb["input_ids"], mb["attention_mask"],
                                     mb["responses"].shape[1], vision.images_of(mb))
        mask = ordered_after(mb["response_mask"], vpreds)
        weight = share_of_normaliser(mask, totals, c.loss_agg_mode)
        vf_loss, clipfrac = losses.compute_value_loss(
            vpreds, mb["returns"], mb["values"], mask, c.cliprange_value, c.loss_agg_mode,
            self.horizon,
        )
        p = self.METRICS
        metrics = {
            f"{p}/vf_loss": vf_loss * weight,
            f"{p}/vf_clipfrac": clipfrac * weight,
            f"{p}/vpred_mean": core.masked_mean(vpreds, mask) * weight,
        }
        return vf_loss * weight, metrics

    @method(DP_COMPUTE, reads=("response_mask", "values", "returns", *SEQUENCES),
            may_read=("rollout_rs_mask", *vision.IMAGES))
    def update_critic(self, batch: Batch) -> dict[str, jax.Array]:
        """Value-loss epochs over shuffled mini-batches; returns mean metrics. A rollout
        correction's rejected tokens (`rollout_rs_mask` 0) leave the loss."""
        return self._update_critic(batch)

    def _update_critic(self, batch: Batch) -> dict[str, jax.Array]:
        c = self.spec
        if self.VALUES != "values":  # the loss reads the generic names
            batch = batch.union(Batch({"values": batch[self.VALUES],
                                       "returns": batch[self.RETURNS]}))
        if "rollout_rs_mask" in batch:
            # A rollout correction's rejected tokens leave the value loss (as its advantages).
            keep = responses.keep_tokens(batch["response_mask"], batch["rollout_rs_mask"])
            batch = batch.select([k for k in batch.arrays if k != "response_mask"]).union(
                Batch({"response_mask": keep}))
        keys = ["input_ids", "attention_mask", "responses", "response_mask", "values", "returns",
                *(k for k in vision.IMAGES if k in batch)]
        out = self.train(self._loss, batch, keys, mini=c.ppo_mini_batch_size * self.rollout.n,
                         micro=c.ppo_micro_batch_size, epochs=c.ppo_epochs, shuffle=c.shuffle,
                         budget=self.budget, grouped=self.grouped)
        p = self.METRICS
        out[f"{p}/grad_norm"] = out.pop("grad_norm")
        out[f"{p}/nonfinite_updates"] = out.pop("nonfinite")
        out[f"{p}/nonfinite_params"] = out.pop("nonfinite_params")
        out.pop("loss")
        return out


class CostCritic(Critic):
    """Safe-RLHF's cost critic: a ValueModel estimating the cost-to-go, trained on
    `cost_returns`; reports metrics under cost_critic/."""

    VALUES, RETURNS, METRICS = "cost_values", "cost_returns", "cost_critic"

    @method(DP_COMPUTE, reads=SEQUENCES, may_read=vision.IMAGES)
    def compute_values(self, batch: Batch) -> Batch:
        """Batch with `cost_values` [B, R]."""
        return self._compute_values(batch)

    @method(DP_COMPUTE, reads=("response_mask", "cost_values", "cost_returns", *SEQUENCES),
            may_read=("rollout_rs_mask", *vision.IMAGES))
    def update_critic(self, batch: Batch) -> dict[str, jax.Array]:
        """Value-loss epochs on the cost returns; returns mean metrics."""
        return self._update_critic(batch)

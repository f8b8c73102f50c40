"""The actor's SFT warm start: cross-entropy on demonstrations' responses before RL.

`WarmStart` is a mixin of `hfjax.workers.actor.ActorRollout`: the warm start trains the same
parameters, with the same micro-batching and the same optimizer machinery as the RL update
(`WorkerGroup.train`), only with another loss, and scores held-out demonstrations
(`compute_sft_nll`, hfjax.run.sft). A mixture of experts trained from scratch adds its router
losses here as in the RL update (`hfjax.workers.routing`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hfjax.controller.batch import Batch
from hfjax.controller.protocol import DP_COMPUTE, method
from hfjax.engine.update import share_of_normaliser
from hfjax.models import moe
from hfjax.numerics import core
from hfjax.workers import routing, vision
from hfjax.workers.base import SEQUENCES, Program, StepShape
from hfjax.workers.logprobs import response_logprobs


class WarmStart:
    """The warm start's loss, update, programs and held-out score, on an actor group."""

    def _sft_loss(self, params, mb, totals):
        model = self.model(params)
        with self.seeing(model, mb), moe.collecting() as routed:
            lp, _ = response_logprobs(model, mb["input_ids"], mb["attention_mask"],
                                      mb["responses"].shape[1], 1.0, chunk=self.chunk,
                                      dp=self.dp_size)
        mask = mb["response_mask"]
        loss = -core.masked_sum(lp, mask) / totals["tokens"]
        metrics = {}
        if routed:  # a mixture of experts trained from scratch: its router losses here too
            weight = share_of_normaliser(mask, totals, "token-mean")
            loss = loss + routing.update_terms(moe.merge(routed), self.spec, mb, 1, weight,
                                               totals, metrics) * weight
        return loss, metrics

    def warm_start_programs(self, batch_size: int, micro: int,
                            shape: StepShape) -> list[Program]:
        """The SFT warm start's update (`update_sft`) on `batch_size` sequences in
        micro-batches of `micro`, with the optimizer installed now (the warm start's)."""
        mb = self.abstract_sequences(batch_size, shape)
        return self.update_programs("update_sft", self._sft_loss, mb, micro)

    def _sft_nll_fn(self, params, input_ids, attention_mask, responses, response_mask):
        lp, _ = response_logprobs(self.model(params), input_ids, attention_mask,
                                  responses.shape[1], 1.0, chunk=self.chunk, dp=self.dp_size)
        return {"nll": -core.masked_sum(lp, response_mask),
                "tokens": jnp.sum(response_mask).astype(jnp.float32)}

    @method(DP_COMPUTE, reads=("response_mask", *SEQUENCES))
    def compute_sft_nll(self, batch: Batch) -> dict[str, jax.Array]:
        """Summed negative log-likelihood of the loss-masked response tokens of `batch`, and
        their count (device scalars): held-out SFT loss = nll / tokens, summed over batches.
        Padding rows that dispatch adds repeat real rows, so callers pass batches whose size
        the data-parallel size divides."""
        if not hasattr(self, "_sft_nll"):
            self._sft_nll = self.jit(self._sft_nll_fn)
        return self._sft_nll(self.params, batch["input_ids"], batch["attention_mask"],
                             batch["responses"], batch["response_mask"])

    @method(DP_COMPUTE, reads=("response_mask", *SEQUENCES), may_read=vision.IMAGES)
    def update_sft(self, batch: Batch, micro: int) -> dict[str, jax.Array]:
        """One cross-entropy step on the responses of `batch` (the warm start); a mixture of
        experts adds its router losses (`actor.moe_aux_loss_coef`, `moe_z_loss_coef`) and logs
        them with its load spread as sft/moe_aux_loss, sft/expert_load_min, ..."""
        keys = ["input_ids", "attention_mask", "responses", "response_mask",
                *(k for k in vision.IMAGES if k in batch)]
        m = self.train(self._sft_loss, batch, keys, mini=len(batch), micro=micro, epochs=1,
                       shuffle=False)
        out = {"sft/loss": m["loss"], "sft/grad_norm": m["grad_norm"],
               "sft/nonfinite_updates": m["nonfinite"],
               "sft/nonfinite_params": m["nonfinite_params"]}
        return out | {"sft/" + k.split("/")[1]: v for k, v in m.items() if k.startswith("actor/")}

"""A user's algorithm, kept outside hfjax (the tests load it by file path, as a user would with
--config.algorithm=path/to/user_algo_module.py:step): a new role with its own Flax NNX module
and worker group, a config key of its own (probe.mesh), a new advantage estimator, and a driver
that uses them."""

import jax
import jax.numpy as jnp
from flax import nnx

from hfjax.algorithms.dataflow import compute_advantage, reward, sample
from hfjax.algorithms.registry import register_algorithm
from hfjax.config import Check, register_keys
from hfjax.controller.batch import Batch
from hfjax.controller.protocol import DP_COMPUTE, method
from hfjax.models import transformer
from hfjax.numerics import ADV_ESTIMATORS
from hfjax.parallel.mesh import MeshSpec
from hfjax.workers.base import WorkerGroup
from hfjax.workers.groups import register_role


class MeanPoolHead(nnx.Module):
    """A new head: the decoder trunk and a scalar read from the mean of the real tokens'
    hidden states."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        self.config = cfg
        self.model = transformer.Backbone(cfg, rngs=rngs)
        self.head = nnx.Param(0.02 * jax.random.normal(rngs.params(), (cfg.hidden_size,)),
                              logical_axes=("embed",))

    def __call__(self, input_ids, attention_mask):
        hidden, _ = self.model(input_ids, attention_mask)
        m = attention_mask.astype(hidden.dtype)[..., None]
        pooled = jnp.sum(hidden * m, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1.0)
        return pooled @ self.head[...]


class Probe(WorkerGroup):
    """The new role's worker group: one probe value per sequence."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._probe = self.jit(lambda p, ids, mask: self.model(p)(ids, mask))

    @method(DP_COMPUTE, reads=("input_ids", "attention_mask"))
    def probe(self, batch: Batch) -> Batch:
        return Batch({"probe": self._probe(self.params, batch["input_ids"],
                                           batch["attention_mask"])})


def build_probe(ctx):
    model = MeanPoolHead(ctx.actor.config, rngs=nnx.Rngs(ctx.cfg.seed + 7))
    return Probe("probe", ctx.pools["probe"], ctx.section("probe").get("mesh", "fsdp=-1"),
                 model, home=ctx.home)


register_role("probe", build_probe, side="score")


def _mesh(v):
    try:
        MeshSpec.parse(v)
    except (TypeError, ValueError) as err:
        return str(err)
    return None


# The role's own config section: a config may set probe.mesh (checked like any key).
register_keys({"probe.mesh": Check(_mesh)})


@ADV_ESTIMATORS.register("user_centered", group=True)
def centered(x):
    """Score minus the group's mean, on every response token (no std division)."""
    m = x.response_mask.astype(x.token_level_rewards.dtype)
    scores = jnp.sum(x.token_level_rewards, axis=-1)
    sums = jax.ops.segment_sum(scores, x.index, num_segments=x.num_groups)
    counts = jax.ops.segment_sum(jnp.ones_like(scores), x.index, num_segments=x.num_groups)
    adv = (scores - (sums / counts)[x.index])[:, None] * m
    return adv, adv


@register_algorithm("user_grpo_probe", roles=("actor", "reward", "probe"))
def step(w, batch, spec):
    batch = sample(w, batch, spec)
    batch = reward(w, batch, spec)
    batch = batch.union(w.run("probe", w.probe.probe, batch))
    batch, metrics = w.run("adv", compute_advantage, batch, spec, w.kl_ctrl.value)
    metrics |= w.run("update_actor", w.actor.update_actor, batch)
    metrics["probe/mean"] = jnp.mean(batch["probe"])
    return batch, metrics

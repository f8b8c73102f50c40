"""The worker groups of one run, typed by role, and how a config builds them on its pools.

`WorkerGroups` is what an algorithm driver receives: one handle per role (an editor follows
`w.actor.generate` straight into `ActorRollout`), the mesh the dataflow keeps its batch on
(`home`, the actor's), the KL coefficient controller, and stage timing (`run`).

The builders turn the config's model, placement and mesh settings into those groups: the actor
first (before the warm start, with its sampler and 3D-HybridEngine), the rest of the roles
after it, each on its pool's mesh with `home` set so that every method's results come back to
the actor's mesh.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from hfjax.controller.batch import Batch
from hfjax.engine.layout_choice import actor_rules_and_engine
from hfjax.engine.sampler import Sampler
from hfjax.engine.update import make_optimizer
from hfjax.models import transformer
from hfjax.models.config import ModelConfig
from hfjax.numerics.losses import FixedKLController, KLController, get_kl_controller
from hfjax.parallel.mesh import ResourcePool
from hfjax.workers.actor import ActorRollout, Reference
from hfjax.workers.critic import Critic
from hfjax.workers.reward import RuleReward


@dataclasses.dataclass
class WorkerGroups:
    """The worker groups of one run; roles an algorithm does not use are None."""

    actor: ActorRollout
    reward: RuleReward
    ref: Reference | None = None
    critic: Critic | None = None
    kl_ctrl: KLController = dataclasses.field(default_factory=lambda: FixedKLController(0.0))
    sync_timing: bool = True
    timing: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def home(self) -> Mesh:
        """The mesh the dataflow keeps its batch on: every method's results come back here."""
        return self.actor.mesh

    def run(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Runs one stage, `fn(*args)`, and returns its result, timed as `timing_s/<name>`.

        With sync_timing the time waits for the result's arrays, so it is the stage's own;
        without it, only dispatch is timed and worker groups on disjoint pools can overlap.
        """
        t0 = time.perf_counter()
        out = fn(*args)
        if self.sync_timing:
            jax.block_until_ready(
                jax.tree.map(lambda x: x.arrays if isinstance(x, Batch) else x, out,
                             is_leaf=lambda x: isinstance(x, Batch))
            )
        self.timing[f"timing_s/{name}"] = time.perf_counter() - t0
        return out


def scratch_model_config(m, vocab_size: int, pad_id: int, eos_id: int,
                         max_positions: int, compute_dtype: str = "float32") -> ModelConfig:
    """The config of a model trained from scratch, from the `model` config section; it holds
    `max_positions` tokens (the task's longest prompt plus response) and computes in
    `compute_dtype` (`model.dtype` resolved for the platform) over `model.param_dtype`
    weights."""
    return ModelConfig(
        vocab_size=m.vocab_size or vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_layers=m.num_layers,
        num_heads=m.num_heads,
        num_kv_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        tie_word_embeddings=True,
        param_dtype=m.get("param_dtype", "float32"),
        dtype=compute_dtype,
        scan_layers=m.scan_layers,
        remat_policy=m.remat_policy,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        max_position_embeddings=max_positions,
    )


def build_actor(cfg, model: nnx.Module, pools: Mapping[str, ResourcePool], pad_id: int,
                eos_id: int) -> ActorRollout:
    """The actor on its pool, with its sampler and, when `rollout.mesh` asks for one, the
    3D-HybridEngine; its optimizer is the warm start's until `build_groups` swaps in RL's."""
    c = cfg
    pool = pools["actor"]
    mesh = pool.mesh(c.actor.mesh)
    # Built first so that a decode layout that cannot hold the model fails before compiling;
    # rules "auto" pick the training rules that nest inside rollout.mesh.
    rules, engine = actor_rules_and_engine(mesh, c.actor.get("rules", "auto"), c.rollout,
                                           nnx.state(model))
    sampler = Sampler(model, mesh=engine.decode_mesh if engine else mesh,
                      max_prompt_len=c.data.max_prompt_length, pad_id=pad_id, rules=None,
                      param_rules=engine.decode_rules if engine else rules)
    return ActorRollout(
        "actor", pool, c.actor.mesh, model, rules=rules,
        sampler=sampler, actor_cfg=c.actor, rollout_cfg=c.rollout,
        optimizer=make_optimizer(c.sft.lr, grad_clip=c.actor.grad_clip),
        eos_ids=(eos_id,), hybrid=engine, home=mesh,
    )


def build_reward(cfg, tokenizer, home: Mesh) -> RuleReward:
    """The rule reward, scoring on the host and returning its scores to `home`."""
    r = cfg.reward
    return RuleReward(tokenizer, custom_fn=r.custom_fn or None, num_processes=r.num_processes,
                      timeout_s=r.timeout_s, home=home)


def needs_ref(cfg, roles: tuple[str, ...]) -> bool:
    """Whether the run builds a reference policy: the algorithm has the role and a KL term
    (in the loss or in the reward) reads it."""
    return "ref" in roles and bool(cfg.actor.use_kl_loss or cfg.algo.use_kl_in_reward)


def build_groups(cfg, actor: ActorRollout, reward: RuleReward, roles: tuple[str, ...],
                 pools: Mapping[str, ResourcePool]) -> WorkerGroups:
    """The RL worker groups around a (warm-started) actor: the actor gets RL's optimizer, the
    reference copies its weights, the critic starts from its trunk."""
    c = cfg
    home = actor.mesh
    actor.set_optimizer(make_optimizer(c.actor.lr, weight_decay=c.actor.weight_decay,
                                       grad_clip=c.actor.grad_clip))
    policy = actor.model()
    ref = None
    if needs_ref(c, roles):
        ref = Reference("ref", pools["ref"], c.ref.mesh, policy,
                        temperature=c.rollout.temperature, home=home)
    critic = None
    if "critic" in roles:
        value_model = (transformer.abstract(actor.config, "value") if actor.abstract
                       else transformer.build(actor.config, "value", seed=c.seed + 1))
        nnx.update(value_model.model, nnx.state(policy.model))
        critic = Critic(
            "critic", pools["critic"], c.critic.mesh, value_model,
            critic_cfg=c.critic, n_samples=c.rollout.n, horizon=c.rollout.response_length,
            optimizer=make_optimizer(c.critic.lr, weight_decay=c.critic.weight_decay,
                                     grad_clip=c.critic.grad_clip),
            home=home,
        )
    k = c.algo.kl_ctrl
    return WorkerGroups(actor=actor, reward=reward, ref=ref, critic=critic,
                        kl_ctrl=get_kl_controller(k.type, k.kl_coef, k.target_kl, k.horizon),
                        sync_timing=c.trainer.sync_stage_timing)

"""The worker groups of one run, typed by role, and how a config builds them on its pools.

`WorkerGroups` is what an algorithm driver receives: one handle per role (an editor follows
`w.actor.generate` straight into `ActorRollout`), the mesh the dataflow keeps its batch on
(`home`, the actor's), the KL coefficient controller, and stage timing (`run`).

The builders turn the config's model, placement and mesh settings into those groups: the actor
first (before the warm start, with its sampler and 3D-HybridEngine), the rest of the roles
after it, each by the builder registered for its role (`register_role`), on its pool's mesh
with `home` set so that every method's results come back to the actor's mesh. An algorithm
that needs a role of its own registers it with a builder; nothing here changes.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh
from ml_collections import config_dict

from hfjax.agents import AgentLoop, check_agent_fits
from hfjax.controller import compile_log
from hfjax.controller.batch import Batch
from hfjax.controller.placement import place_role
from hfjax.engine.continuous import rollout_sampler
from hfjax.engine.layout_choice import actor_rules_and_engine
from hfjax.engine.spec import MultiTurnSpec, RolloutSpec
from hfjax.engine.update import make_optimizer
from hfjax.models import load as load_model
from hfjax.models import lora, transformer
from hfjax.models.hf_io import load_score, read_model_config
from hfjax.numerics.losses import (
    FixedKLController,
    KLController,
    LagrangeMultiplier,
    get_kl_controller,
)
from hfjax.parallel.mesh import ResourcePool
from hfjax.rewards.judge import render
from hfjax.tools import ToolRunner, resolve_tools
from hfjax.workers.actor import ActorRollout, BaseReference, Reference
from hfjax.workers.critic import CostCritic, Critic
from hfjax.workers.judge import Judge
from hfjax.workers.judge import check_vocabulary as check_judge_vocabulary
from hfjax.workers.reward import RuleReward, parse_source_weights
from hfjax.workers.score import ModelReward
from hfjax.workers.spec import ActorSpec, CriticSpec, ScoreSpec
from hfjax.workers.teacher import Teacher, check_vocabulary


@dataclasses.dataclass
class WorkerGroups:
    """The worker groups of one run; roles an algorithm does not use are None.

    Built-in roles are typed fields; the groups of roles an algorithm registers itself
    (`register_role`) are in `roles` and read as attributes too (`w.my_role`). `lagrange` is
    Safe-RLHF's multiplier; `next_prompts(attempt)` gives another host batch of prompts for
    the current step (DAPO's dynamic sampling draws from it).
    """

    actor: ActorRollout
    reward: RuleReward
    ref: Reference | None = None
    critic: Critic | None = None
    cost_critic: CostCritic | None = None
    reward_model: ModelReward | None = None
    cost_model: ModelReward | None = None
    roles: dict[str, Any] = dataclasses.field(default_factory=dict)
    kl_ctrl: KLController = dataclasses.field(default_factory=lambda: FixedKLController(0.0))
    lagrange: LagrangeMultiplier | None = None
    next_prompts: Callable[[int], Batch] | None = None
    # Where `sample` takes a step's responses from: None, the actor generates them; in an
    # asynchronous run, the rollout pool's queue (`hfjax.run.async_loop`).
    rollout_source: Callable[[Batch], Batch] | None = None
    sync_timing: bool = True
    timing: dict[str, float] = dataclasses.field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails: the groups of registered user roles.
        roles = self.__dict__.get("roles") or {}
        if name in roles:
            return roles[name]
        raise AttributeError(f"WorkerGroups has no role {name!r}; built roles: "
                             f"{', '.join(self.built_roles())}")

    def built_roles(self) -> tuple[str, ...]:
        """The roles that have a worker group in this run."""
        fixed = [f.name for f in dataclasses.fields(self) if f.name in ROLE_FIELDS
                 and getattr(self, f.name) is not None]
        return (*fixed, *self.roles)

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
        with compile_log.stage(name):
            out = fn(*args)
            if self.sync_timing:
                jax.block_until_ready(
                    jax.tree.map(lambda x: x.arrays if isinstance(x, Batch) else x, out,
                                 is_leaf=lambda x: isinstance(x, Batch))
                )
        self.timing[f"timing_s/{name}"] = time.perf_counter() - t0
        return out


# The built-in roles with a typed field in WorkerGroups.
ROLE_FIELDS = ("actor", "reward", "ref", "critic", "cost_critic", "reward_model", "cost_model")


def build_actor(cfg, model: nnx.Module, pools: Mapping[str, ResourcePool], pad_id: int,
                eos_id: int, tokenizer=None, tower: nnx.Module | None = None,
                vl=None) -> ActorRollout:
    """The actor on its pool, with its sampler and, when `rollout.mesh` asks for one, the
    3D-HybridEngine; its optimizer is the warm start's until `build_groups` swaps in RL's.
    A vision-language policy passes its `VLConfig` (`vl`) and a frozen `tower` (or a `model`
    holding its tower as `visual`, `hfjax.models.qwen2_5_vl.policy`).
    With `rollout.multi_turn.enable` it rolls out multi-turn trajectories with tools
    (`build_agent`), which needs the run's `tokenizer`."""
    c = cfg
    pool = pools["actor"]
    mesh = pool.mesh(c.actor.mesh)
    # Built first so that a decode layout that cannot hold the model fails before compiling;
    # rules "auto" pick the training rules that nest inside rollout.mesh.
    rollout = RolloutSpec.of(c.rollout)
    rules, engine = actor_rules_and_engine(mesh, c.actor.rules,
                                           rollout.decode_mesh, nnx.state(model))
    turns = rollout.multi_turn.enable
    # Later turns keep their cache (hfjax.engine.session): only prompts are prefilled whole.
    sampler = rollout_sampler(model, rollout, mesh=engine.decode_mesh if engine else mesh,
                              max_prompt_len=c.data.max_prompt_length, pad_id=pad_id, rules=None,
                              param_rules=engine.decode_rules if engine else rules)
    return ActorRollout(
        "actor", pool, c.actor.mesh, model, rules=rules,
        sampler=sampler, spec=ActorSpec.of(c.actor), rollout=rollout,
        optimizer=make_optimizer(c.sft.lr, grad_clip=c.actor.grad_clip,
                                 decay_steps=c.sft.steps if c.sft.get("lr_schedule") == "cosine"
                                 else 0),
        eos_ids=(eos_id,), hybrid=engine, home=mesh, tower=tower, vl=vl,
        sequence_parallel=c.actor.sequence_parallel,
        agent=(build_agent(rollout.multi_turn, sampler, tokenizer, c.data.max_prompt_length,
                           rollout.response_length) if turns else None),
    )


def build_agent(spec: MultiTurnSpec, sampler, tokenizer, max_prompt_length: int,
                response_length: int) -> AgentLoop:
    """The multi-turn loop of `rollout.multi_turn` (`spec`) over `sampler`: the tools it names
    run in a `ToolRunner` of `tool_workers` threads. Refuses, before anything compiles, a
    sampler that cannot hold prompts of `max_prompt_length` tokens, or rows of those plus
    `response_length` tokens within its `max_cache_len` (`check_agent_fits`)."""
    if tokenizer is None:
        raise ValueError("rollout.multi_turn.enable needs the run's tokenizer (to read tool "
                         "calls and write their results); pass tokenizer= to build_actor")
    if jax.process_count() > 1:
        # The loop reads every row's tokens on the host and runs its tools there; across
        # processes each would need the whole batch and identical tool results.
        raise ValueError("rollout.multi_turn.enable runs on one process for now; run it on one "
                         "host (every device of it), or set --config.rollout.multi_turn."
                         "enable=False")
    check_agent_fits(sampler, max_prompt_length, response_length)
    runner = ToolRunner(resolve_tools(spec.tools, spec.tool_options()),
                        max_workers=spec.tool_workers)
    try:
        return AgentLoop(sampler, tokenizer, runner, spec)
    except ValueError:  # a setting the loop refuses: its runner's threads go too
        runner.close()
        raise


def build_reward(cfg, tokenizer, home: Mesh) -> RuleReward:
    """The rule reward, scoring on the host and returning its scores to `home`, with the
    per-data_source weights that combine it with a reward model's and a judge's scores."""
    r = cfg.reward
    return RuleReward(tokenizer, custom_fn=r.custom_fn or None, num_processes=r.num_processes,
                      timeout_s=r.timeout_s, home=home, rule_weight=r.rule_weight,
                      model_weight=r.model_weight, judge_weight=r.judge_weight,
                      sources=parse_source_weights(r.sources))


def needs_ref(cfg, roles: tuple[str, ...]) -> bool:
    """Whether the run builds a reference policy: the algorithm has the role and a KL term
    (in the loss or in the reward) reads it."""
    return "ref" in roles and bool(cfg.actor.use_kl_loss or cfg.algo.use_kl_in_reward)


# -- roles and their builders -------------------------------------------------------------------


@dataclasses.dataclass
class BuildContext:
    """What a role's builder may use: the config, the (warm-started) actor, the resource pool
    of every active role, the run's active roles, the actor's current weights as a model, and
    the run's tokenizer."""

    cfg: Any
    actor: ActorRollout
    pools: Mapping[str, ResourcePool]
    roles: tuple[str, ...]
    policy: nnx.Module
    tokenizer: Any = None

    @property
    def home(self) -> Mesh:
        return self.actor.mesh

    def section(self, role: str):
        """The config section named after the role (empty if the config has none)."""
        return self.cfg.get(role) or config_dict.ConfigDict()


RoleBuilder = Callable[[BuildContext], Any]
ROLE_BUILDERS: dict[str, RoleBuilder] = {}


def register_role(name: str, builder: RoleBuilder, *, side: str = "score") -> None:
    """Registers a role: placements accept it (on `side` of a `split` placement, "generate"
    or "score") and `build_groups` builds its worker group with `builder(ctx: BuildContext)`
    for any algorithm that lists it in its roles. A driver reads the group as `w.<name>`."""
    if name in ("actor", "rollout", "reward"):
        raise ValueError(f"role {name!r} is built by the trainer, not by a role builder")
    place_role(name, side)
    ROLE_BUILDERS[name] = builder


def _build_ref(ctx: BuildContext) -> Reference | None:
    c = ctx.cfg
    if not needs_ref(c, ctx.roles):
        return None
    if ctx.actor.trainable is not None:
        # LoRA: the reference is the actor's frozen base (adapters off), no copy of it, on
        # the actor's pool (`hfjax.config.check.validate_config` refuses another).
        return BaseReference("ref", ctx.actor)
    # The reference scores in the actor's packing and micro-batches, as in verl.
    return Reference("ref", ctx.pools["ref"], c.ref.mesh, ctx.policy, home=ctx.home,
                     sequence_parallel=c.ref.sequence_parallel, spec=ctx.actor.spec,
                     rollout=ctx.actor.rollout, vl=ctx.actor.vl)


def _critic_builder(role: str, cls: type[Critic], seed_offset: int) -> RoleBuilder:
    def build(ctx: BuildContext) -> Critic:
        c, s = ctx.cfg, ctx.section(role)
        # A critic starts from the policy's trunk, with a zero value head.
        # A dry run's actor is abstract (shapes only): so is its critic.
        value_model = (transformer.abstract(ctx.actor.config, "value") if ctx.actor.abstract
                       else transformer.build(ctx.actor.config, "value",
                                              seed=c.seed + seed_offset))
        nnx.update(value_model.model, lora.base_state(nnx.state(ctx.policy.model)))
        spec = lora.spec_from_config(s)
        if spec is not None:  # adapters on the critic's trunk; its value head trains whole
            lora.add_adapters(value_model, spec, seed=c.seed + seed_offset + 7)
        return cls(
            role, ctx.pools[role], s.mesh, value_model,
            spec=CriticSpec.of(s, role), rollout=ctx.actor.rollout,
            optimizer=make_optimizer(s.lr, weight_decay=s.weight_decay, grad_clip=s.grad_clip),
            home=ctx.home, sequence_parallel=s.sequence_parallel, vl=ctx.actor.vl,
        )

    return build


def _score_builder(role: str, output: str) -> RoleBuilder:
    def build(ctx: BuildContext) -> ModelReward:
        s = ctx.section(role)
        spec = ScoreSpec.of(s, role)
        if ctx.actor.abstract:
            # A dry run: the architecture from config.json (a .gguf's metadata, a preset's
            # shapes) as `load_score` would build it, shapes only; no weight is read.
            model = transformer.abstract(read_model_config(spec.path, dtype=spec.dtype), "score")
        else:
            # A checkpoint without a trained score head is refused (run_config checks it first).
            # Loaded straight onto its pool (each process places its own shards), which may
            # span processes that the first device's process is not one of.
            model = load_score(spec.path, what=f"{role}.path", dtype=spec.dtype,
                               mesh=ctx.pools[role].mesh(s.mesh))
        return ModelReward(role, ctx.pools[role], s.mesh, model, output=output, home=ctx.home,
                           budget=spec.budget, sequence_parallel=s.sequence_parallel)

    return build


def _build_teacher(ctx: BuildContext) -> Teacher:
    """The teacher from teacher.path, on its pool's mesh, scoring as the reference does."""
    s = ctx.section("teacher")
    config = read_model_config(s.path, dtype=s.dtype)
    check_vocabulary(s.path, config.vocab_size, ctx.actor.config.vocab_size)
    model = transformer.abstract(config) if ctx.actor.abstract else load_model(s.path,
                                                                               dtype=s.dtype)
    return Teacher("teacher", ctx.pools["teacher"], s.mesh, model, home=ctx.home,
                   sequence_parallel=s.sequence_parallel, spec=ctx.actor.spec,
                   rollout=ctx.actor.rollout)


def _build_judge(ctx: BuildContext) -> Judge:
    """The generative judge from reward.judge.path, on its pool's mesh, reading and writing
    with the run's tokenizer."""
    c = ctx.cfg
    j = c.reward.judge
    config = read_model_config(j.path, dtype=j.dtype)
    check_judge_vocabulary(j.path, config.vocab_size, ctx.actor.config.vocab_size)
    # Loaded straight into its decode layout on its own pool's devices (each process reads and
    # places its own shards): no whole copy on one device, none moved between processes.
    model = (transformer.abstract(config) if ctx.actor.abstract
             else load_model(j.path, dtype=j.dtype, mesh=ctx.pools["judge"].mesh(j.mesh),
                             rules="decode"))
    # The longest judge prompt: the template's own tokens, a prompt's and a response's.
    template = len(ctx.tokenizer.encode(render(j.template, "", ""), add_special_tokens=False))
    longest = template + c.data.max_prompt_length + c.rollout.response_length
    return Judge("judge", ctx.pools["judge"], j.mesh, model, tokenizer=ctx.tokenizer,
                 template=j.template, parser=j.parser, max_verdict_tokens=j.max_verdict_tokens,
                 default_score=j.default_score, timeout_s=j.timeout_s,
                 num_processes=c.reward.num_processes, prompt_len=longest, home=ctx.home)


register_role("ref", _build_ref, side="generate")
register_role("teacher", _build_teacher)
register_role("judge", _build_judge)
register_role("critic", _critic_builder("critic", Critic, 1))
register_role("cost_critic", _critic_builder("cost_critic", CostCritic, 2))
register_role("reward_model", _score_builder("reward_model", "rm_scores"))
register_role("cost_model", _score_builder("cost_model", "cost_scores"))


def build_groups(cfg, actor: ActorRollout, reward: RuleReward, roles: tuple[str, ...],
                 pools: Mapping[str, ResourcePool]) -> WorkerGroups:
    """The RL worker groups around a (warm-started) actor: the actor gets RL's optimizer, and
    every other role of `roles` is built by its registered builder (the reference copies the
    actor's weights, critics start from its trunk, reward and cost models load their
    checkpoints)."""
    c = cfg
    actor.set_optimizer(make_optimizer(c.actor.lr, weight_decay=c.actor.weight_decay,
                                       grad_clip=c.actor.grad_clip))
    spec = lora.spec_from_config(c.actor)
    if spec is not None and actor.trainable is None:
        # RL trains adapters on the model it starts from (after the warm start, if any):
        # that model is the frozen base, and the reference.
        actor.add_adapters(spec, seed=c.seed + 7)
    ctx = BuildContext(cfg, actor, pools, tuple(roles), actor.model(), reward.tokenizer)
    built: dict[str, Any] = {}
    for role in roles:
        if role in ("actor", "reward"):
            continue
        if role not in ROLE_BUILDERS:
            raise ValueError(f"role {role!r} has no builder; register it with "
                             "hfjax.workers.groups.register_role(name, builder)")
        built[role] = ROLE_BUILDERS[role](ctx)
    fixed = {k: v for k, v in built.items() if k in ROLE_FIELDS}
    extra = {k: v for k, v in built.items() if k not in ROLE_FIELDS}
    k = c.algo.kl_ctrl
    return WorkerGroups(actor=actor, reward=reward, roles=extra, **fixed,
                        kl_ctrl=get_kl_controller(k.type, k.kl_coef, k.target_kl, k.horizon),
                        lagrange=lagrange_of(c) if "cost_model" in roles else None,
                        sync_timing=c.trainer.sync_stage_timing)


def lagrange_of(cfg) -> LagrangeMultiplier:
    """Safe-RLHF's multiplier at the start of a run, from `algo.safe_rlhf`."""
    s = cfg.algo.safe_rlhf
    return LagrangeMultiplier.create(s.lambda_init, s.lambda_lr, s.cost_threshold,
                                     s.lambda_max)

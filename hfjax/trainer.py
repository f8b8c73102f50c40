"""The training loop: builds worker groups from a config, then runs warm start, RL steps and
validation. It talks to the user only through the `on_step` / `on_log` callbacks that the
launcher passes in."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hfjax.algorithms import core
from hfjax.algorithms.dataflow import Workers
from hfjax.algorithms.registry import get_algorithm
from hfjax.controller.batch import Batch
from hfjax.controller.placement import resolve_placement
from hfjax.data import arith
from hfjax.engine.sampler import Sampler
from hfjax.engine.update import check_mini_batching, make_optimizer
from hfjax.models import transformer
from hfjax.models.config import ModelConfig
from hfjax.parallel.mesh import MeshSpec, dp_size
from hfjax.workers.actor import ActorRollout, Reference
from hfjax.workers.critic import Critic
from hfjax.workers.reward import RuleReward


def left_pad(seqs: list[list[int]], width: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask) int32 [N, width], each sequence right-aligned."""
    ids = np.full((len(seqs), width), pad_id, np.int32)
    mask = np.zeros((len(seqs), width), np.int32)
    for i, s in enumerate(seqs):
        if len(s) > width:
            raise ValueError(f"sequence {i} has {len(s)} tokens, more than the limit {width}")
        if s:
            ids[i, width - len(s) :] = s
            mask[i, width - len(s) :] = 1
    return ids, mask


def right_pad(seqs: list[list[int]], width: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask) int32 [N, width], each sequence left-aligned and cut at width."""
    ids = np.full((len(seqs), width), pad_id, np.int32)
    mask = np.zeros((len(seqs), width), np.int32)
    for i, s in enumerate(seqs):
        s = s[:width]
        ids[i, : len(s)] = s
        mask[i, : len(s)] = 1
    return ids, mask


def render_prompt(tok, messages: list[dict]) -> list[int]:
    """Prompt ids: the chat template when the tokenizer has one, else the last message text."""
    if getattr(tok, "chat_template", None):
        return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return tok.encode(messages[-1]["content"], add_special_tokens=False)


def validate_config(cfg) -> Any:
    """Checks names and batch arithmetic before anything is built; returns the Algorithm."""
    algo = get_algorithm(cfg.algorithm)
    core.ADV_ESTIMATORS.get(cfg.algo.adv_estimator)
    core.POLICY_LOSSES.get(cfg.actor.policy_loss)
    core.LOSS_AGG_MODES.get(cfg.actor.loss_agg_mode)
    core.kl_penalty(jnp.zeros(()), jnp.zeros(()), cfg.algo.kl_penalty)
    if cfg.actor.use_kl_loss:
        core.kl_penalty(jnp.zeros(()), jnp.zeros(()), cfg.actor.kl_loss_type)
    n_seq = cfg.data.train_batch_size * cfg.rollout.n
    pools = resolve_placement(_placement(cfg), _active_roles(algo), jax.devices())
    dp = dp_size(MeshSpec.parse(cfg.actor.mesh).build(pools["actor"].devices, "actor"))
    check_mini_batching(n_seq, cfg.actor.ppo_mini_batch_size * cfg.rollout.n,
                        cfg.actor.ppo_micro_batch_size, dp, "actor")
    if "ref" in algo.roles and (cfg.actor.use_kl_loss or cfg.algo.use_kl_in_reward):
        # Built only after the warm start, so a bad mesh must be caught here, not there.
        MeshSpec.parse(cfg.ref.mesh).build(pools["ref"].devices, "ref")
    if "critic" in algo.roles:
        dpc = dp_size(MeshSpec.parse(cfg.critic.mesh).build(pools["critic"].devices, "critic"))
        check_mini_batching(n_seq, cfg.critic.ppo_mini_batch_size * cfg.rollout.n,
                            cfg.critic.ppo_micro_batch_size, dpc, "critic")
    return algo, pools


def _placement(cfg):
    p = cfg.placement
    return p.to_dict() if hasattr(p, "to_dict") else p


def _active_roles(algo) -> tuple[str, ...]:
    return tuple(r for r in algo.roles if r != "rollout")


class Trainer:
    """Builds the run's worker groups and drives warm start, RL steps and validation."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.algo, self.pools = validate_config(cfg)
        self.tok = arith.tokenizer()
        d = cfg.data
        if d.task != "arith":
            raise ValueError(f"unknown data.task {d.task!r}; the built-in task is 'arith'")
        self.train_rows = arith.problems(d.n_train, seed=cfg.seed, max_b=d.max_b)
        self.test_rows = arith.problems(d.n_test, seed=cfg.seed + 10_000, max_b=d.max_b)
        self.model_cfg = self._model_config()
        self.pad = self.tok.pad_id
        self.eos = self.tok.eos_id
        self._rng = np.random.default_rng(cfg.seed)
        self._order = self._rng.permutation(len(self.train_rows))
        self._cursor = 0
        self.step = 0
        actor_model = transformer.build(self.model_cfg, "causal_lm", seed=cfg.seed)
        self.actor = self._make_actor(actor_model)
        self.workers: Workers | None = None

    # -- construction ------------------------------------------------------------------------

    def _model_config(self) -> ModelConfig:
        m = self.cfg.model
        return ModelConfig(
            vocab_size=m.vocab_size or self.tok.vocab_size,
            hidden_size=m.hidden_size,
            intermediate_size=m.intermediate_size,
            num_layers=m.num_layers,
            num_heads=m.num_heads,
            num_kv_heads=m.num_kv_heads,
            head_dim=m.head_dim,
            tie_word_embeddings=True,
            param_dtype=m.dtype,
            dtype=m.dtype,
            scan_layers=m.scan_layers,
            remat_policy=m.remat_policy,
            pad_token_id=self.tok.pad_id,
            eos_token_id=self.tok.eos_id,
            max_position_embeddings=64,
        )

    def _make_actor(self, model) -> ActorRollout:
        c = self.cfg
        pool = self.pools["actor"]
        mesh = pool.mesh(c.actor.mesh)
        sampler = Sampler(model, mesh=mesh, max_prompt_len=c.data.max_prompt_length,
                          pad_id=self.pad, rules=None)
        return ActorRollout(
            "actor", pool, c.actor.mesh, model,
            sampler=sampler, actor_cfg=c.actor, rollout_cfg=c.rollout,
            optimizer=make_optimizer(c.sft.lr, grad_clip=c.actor.grad_clip),
            eos_ids=(self.eos,),
        )

    def _make_rl_workers(self) -> Workers:
        c = self.cfg
        roles = self.algo.roles
        self.actor.set_optimizer(
            make_optimizer(c.actor.lr, weight_decay=c.actor.weight_decay,
                           grad_clip=c.actor.grad_clip)
        )
        policy = self.actor.model()
        ref = None
        if "ref" in roles and (c.actor.use_kl_loss or c.algo.use_kl_in_reward):
            ref = Reference("ref", self.pools["ref"], c.ref.mesh, policy,
                            temperature=c.rollout.temperature)
        critic = None
        if "critic" in roles:
            value_model = transformer.build(self.model_cfg, "value", seed=c.seed + 1)
            nnx.update(value_model.model, nnx.state(policy.model))
            critic = Critic(
                "critic", self.pools["critic"], c.critic.mesh, value_model,
                critic_cfg=c.critic, n_samples=c.rollout.n,
                optimizer=make_optimizer(c.critic.lr, weight_decay=c.critic.weight_decay,
                                         grad_clip=c.critic.grad_clip),
            )
        a = c.algo
        kl = core.get_kl_controller(a.kl_ctrl.type, a.kl_ctrl.kl_coef, a.kl_ctrl.target_kl,
                                    a.kl_ctrl.horizon)
        return Workers(actor=self.actor, ref=ref, critic=critic, reward=RuleReward(self.tok),
                       kl_ctrl=kl, sync_timing=c.trainer.sync_stage_timing)

    # -- data ----------------------------------------------------------------------------------

    def prompt_batch(self, rows: list[dict], seeds: np.ndarray) -> Batch:
        """Host batch of left-padded prompts with per-row seeds and reward metadata."""
        ids, mask = left_pad([render_prompt(self.tok, r["prompt"]) for r in rows],
                             self.cfg.data.max_prompt_length, self.pad)
        return Batch(
            {"prompts": ids, "prompt_mask": mask, "seeds": seeds.astype(np.int32)},
            meta={
                "data_source": [r["data_source"] for r in rows],
                "ground_truth": [r["reward_model"]["ground_truth"] for r in rows],
            },
        )

    def next_rows(self, n: int) -> list[dict]:
        if self._cursor + n > len(self._order):
            self._order = self._rng.permutation(len(self.train_rows))
            self._cursor = 0
        idx = self._order[self._cursor : self._cursor + n]
        self._cursor += n
        return [self.train_rows[i] for i in idx]

    # -- stages --------------------------------------------------------------------------------

    def warm_start(self, on_log: Callable | None = None) -> dict:
        """Supervised steps on the task's imperfect demonstrations; returns the last metrics."""
        s = self.cfg.sft
        if s.steps <= 0:
            return {}
        pairs = arith.sft_texts(self.train_rows, s.corrupt_frac, seed=self.cfg.seed + 1,
                                corruption=s.corruption)
        p = [self.tok.encode(q, add_special_tokens=False) for q, _ in pairs]
        r = [self.tok.encode(a, add_special_tokens=False) + [self.eos] for _, a in pairs]
        P, R = self.cfg.data.max_prompt_length, self.cfg.rollout.response_length
        pid, pm = left_pad(p, P, self.pad)
        rid, rm = right_pad(r, R, self.pad)
        rng = np.random.default_rng(self.cfg.seed + 2)
        m = {}
        for i in range(s.steps):
            idx = rng.choice(len(pairs), s.batch_size, replace=False)
            b = Batch({
                "input_ids": np.concatenate([pid[idx], rid[idx]], 1),
                "attention_mask": np.concatenate([pm[idx], rm[idx]], 1),
                "responses": rid[idx],
                "response_mask": rm[idx],
            })
            m = self.actor.update_sft(b, s.micro_batch_size)
            if on_log and (i + 1) % 100 == 0:
                on_log(i + 1, {k: float(v) for k, v in jax.device_get(m).items()})
        return {k: float(v) for k, v in jax.device_get(m).items()}

    def validate(self) -> dict[str, float]:
        """Greedy exact-match accuracy on the held-out problems."""
        rows = self.test_rows
        batch = self.prompt_batch(rows, np.zeros(len(rows), np.int32))
        out = self.actor.generate(batch, greedy=True, n=1)
        scored = RuleReward(self.tok).compute_reward(out)
        with jax.transfer_guard("allow"):
            acc = float(jnp.mean(jnp.sum(scored["token_level_scores"], axis=1)))
        return {f"val-core/{arith.DATA_SOURCE}/acc/mean@1": acc}

    def train_step(self) -> dict[str, float]:
        """One RL iteration; returns host metrics (the step's one metrics fetch)."""
        c = self.cfg
        if self.workers is None:
            self.workers = self._make_rl_workers()
        w = self.workers
        w.timing.clear()
        rows = self.next_rows(c.data.train_batch_size)
        seeds = (c.seed * 1_000_003 + self.step * 65_537 + np.arange(len(rows))) % (2**31)
        batch = self.prompt_batch(rows, seeds)
        t0 = time.perf_counter()
        batch, metrics = self.algo.step(w, batch, c)
        metrics |= _batch_metrics(dict(batch.arrays))
        with jax.transfer_guard("allow"):
            host = {k: float(v) for k, v in jax.device_get(metrics).items()}
        wall = time.perf_counter() - t0
        if "actor/reward_kl_penalty" in host:
            w.kl_ctrl = w.kl_ctrl.update(host["actor/reward_kl_penalty"], len(rows))
        host.update(w.timing)
        tokens = host.pop("_tokens")
        host["timing_s/step"] = wall
        host["perf/total_num_tokens"] = tokens
        host["perf/throughput"] = tokens / wall
        host["actor/kl_coef"] = float(w.kl_ctrl.value)
        self.step += 1
        return host


@jax.jit
def _batch_metrics(a: dict) -> dict:
    mask = a["response_mask"].astype(jnp.float32)
    score = jnp.sum(a["token_level_scores"], axis=1)
    length = jnp.sum(mask, axis=1)
    out = {
        "critic/score/mean": jnp.mean(score),
        "critic/rewards/mean": jnp.mean(jnp.sum(a["token_level_rewards"], axis=1)),
        "critic/advantages/mean": core.masked_mean(a["advantages"], mask),
        "critic/returns/mean": core.masked_mean(a["returns"], mask),
        "response_length/mean": jnp.mean(length),
        "_tokens": jnp.sum(a["attention_mask"]).astype(jnp.float32),
    }
    if "values" in a:
        out["critic/values/mean"] = core.masked_mean(a["values"], mask)
    return out

"""The training loop: builds worker groups from a config, then runs warm start, RL steps,
validation, checkpoints and metrics (`Trainer.fit`). It talks to the user only through the
metric sinks and the `on_log` callback that the launcher passes in."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx

from hfjax import checkpoint as ckpt_lib
from hfjax.algorithms import core, losses
from hfjax.algorithms.dataflow import Workers
from hfjax.algorithms.registry import get_algorithm
from hfjax.controller.batch import Batch
from hfjax.controller.placement import resolve_placement
from hfjax.data import arith
from hfjax.data.dataset import Dataset, reward_meta
from hfjax.engine.continuous import rollout_sampler
from hfjax.engine.sampler import MIN_PROMPT_BUCKET, SamplingParams, bucket_size
from hfjax.engine.update import check_mini_batching, make_optimizer
from hfjax.metrics import MetricsLogger, parse_sink_names
from hfjax.models import load as load_model
from hfjax.models import load_tokenizer, transformer
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


def validate_config(cfg) -> Any:
    """Checks names and batch arithmetic before anything is built; returns the Algorithm."""
    algo = get_algorithm(cfg.algorithm)
    core.ADV_ESTIMATORS.get(cfg.algo.adv_estimator)
    core.POLICY_LOSSES.get(cfg.actor.policy_loss)
    core.LOSS_AGG_MODES.get(cfg.actor.loss_agg_mode)
    losses.check_kl_name(cfg.algo.kl_penalty)
    if cfg.actor.use_kl_loss:
        losses.check_kl_name(cfg.actor.kl_loss_type)
    _check_run_keys(cfg.trainer)
    try:  # the validation sampling settings, checked like any request's
        SamplingParams(cfg.rollout.response_length, temperature=cfg.rollout.val_kwargs.temperature,
                       n=cfg.rollout.val_kwargs.n)
    except ValueError as err:
        raise ValueError(f"rollout.val_kwargs: {err}") from err
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


def _check_run_keys(t) -> None:
    parse_sink_names(t.get("logger", ""))
    resume = str(t.get("resume", "auto"))
    if resume not in ("auto", "disable") and not os.path.isdir(resume):
        raise ValueError(f"trainer.resume={resume!r}: not auto, disable or an existing "
                         "checkpoint directory (a run's out_dir, checkpoint root or step dir)")


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
        d = cfg.data
        self.tok = self._tokenizer()
        self.train_data, self.test_data = self._datasets()
        logging.info("train data: %s", self.train_data.report.summary())
        logging.info("validation data: %s", self.test_data.report.summary())
        self.train_iter = self.train_data.iterator(d.train_batch_size, seed=cfg.seed)
        self.pad = self.tok.pad_id
        self.eos = self.tok.eos_id
        self.reward = RuleReward(self.tok, custom_fn=cfg.reward.custom_fn or None,
                                 num_workers=cfg.reward.num_workers,
                                 timeout_s=cfg.reward.timeout_s)
        self.step = 0
        initial = self._initial_model()
        self.model_cfg = initial.config
        self.actor = self._make_actor(initial)
        self.workers: Workers | None = None

    # -- construction ------------------------------------------------------------------------

    def _tokenizer(self):
        path = self.cfg.model.path
        return load_tokenizer(path) if path else arith.tokenizer()

    def _datasets(self):
        """(train, validation) Datasets; bad rows fail or are counted here, before compiling."""
        c, d = self.cfg, self.cfg.data
        if d.task == "arith":
            make = lambda n, seed: Dataset.arith(  # noqa: E731
                n, seed, d.max_prompt_length, tokenizer=self.tok, max_b=d.max_b)
            return make(d.n_train, c.seed), make(d.n_test, c.seed + 10_000)
        if d.task == "parquet":
            kw = dict(custom_reward_fn=c.reward.custom_fn or None)
            return (Dataset.from_parquet(d.train_files.split(","), self.tok,
                                         d.max_prompt_length, **kw),
                    Dataset.from_parquet(d.val_files.split(","), self.tok,
                                         d.max_prompt_length, **kw))
        raise ValueError(f"unknown data.task {d.task!r}; use 'arith' (built in) or 'parquet' "
                         "(with data.train_files and data.val_files)")

    def _initial_model(self):
        """The actor before training: a checkpoint from model.path, else a fresh tiny model."""
        c = self.cfg
        if c.model.path:
            return load_model(c.model.path, dtype=c.model.dtype, scan_layers=c.model.scan_layers,
                              remat_policy=c.model.remat_policy)
        return transformer.build(self._scratch_config(), "causal_lm", seed=c.seed)

    def _scratch_config(self) -> ModelConfig:
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
        # The 3D-HybridEngine (rollout.mesh + rollout.hybrid_engine): built first so that a
        # decode layout that cannot hold the model fails before anything compiles.
        from hfjax.engine.hybrid import engine_for
        from hfjax.parallel.sharding import layout

        rules = c.actor.get("rules", "train")
        engine = engine_for(layout(mesh, rules), c.rollout, nnx.state(model))
        sampler = rollout_sampler(
            model, c.rollout, mesh=engine.decode_mesh if engine else mesh,
            max_prompt_len=c.data.max_prompt_length, pad_id=self.pad, rules=None,
            param_rules=engine.decode_rules if engine else rules)
        return ActorRollout(
            "actor", pool, c.actor.mesh, model, rules=rules,
            sampler=sampler, actor_cfg=c.actor, rollout_cfg=c.rollout,
            optimizer=make_optimizer(c.sft.lr, grad_clip=c.actor.grad_clip),
            eos_ids=(self.eos,), hybrid=engine,
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
                critic_cfg=c.critic, n_samples=c.rollout.n, horizon=c.rollout.response_length,
                optimizer=make_optimizer(c.critic.lr, weight_decay=c.critic.weight_decay,
                                         grad_clip=c.critic.grad_clip),
            )
        a = c.algo
        kl = losses.get_kl_controller(a.kl_ctrl.type, a.kl_ctrl.kl_coef, a.kl_ctrl.target_kl,
                                    a.kl_ctrl.horizon)
        return Workers(actor=self.actor, ref=ref, critic=critic, reward=self.reward,
                       kl_ctrl=kl, sync_timing=c.trainer.sync_stage_timing)

    # -- data ----------------------------------------------------------------------------------

    def prompt_batch(self, rows: list[dict], seeds: np.ndarray) -> Batch:
        """Host batch of left-padded prompts with per-row seeds and reward metadata.

        The width is the longest prompt's length rounded up to a power of two (at least
        MIN_PROMPT_BUCKET), capped at max_prompt_length: no stage computes on columns that are
        padding in every row, and a run compiles a handful of widths.
        """
        ids_list = [r["prompt_ids"] for r in rows]
        width = bucket_size(max(len(i) for i in ids_list), MIN_PROMPT_BUCKET,
                            cap=self.cfg.data.max_prompt_length)
        ids, mask = left_pad(ids_list, width, self.pad)
        return Batch({"prompts": ids, "prompt_mask": mask, "seeds": seeds.astype(np.int32)},
                     meta=reward_meta(rows))

    # -- stages --------------------------------------------------------------------------------

    def warm_start(self, on_log: Callable | None = None,
                   should_stop: Callable[[], bool] | None = None) -> dict:
        """Supervised steps on the task's imperfect demonstrations; returns the last metrics
        (empty when `should_stop` ended it early)."""
        s = self.cfg.sft
        if s.steps <= 0:
            return {}
        if self.cfg.data.task != "arith":
            raise ValueError("sft.steps > 0 needs data.task='arith' (the warm start uses its "
                             "demonstrations); set --config.sft.steps=0 for other data")
        pairs = arith.sft_texts(self.train_data.rows, s.corrupt_frac, seed=self.cfg.seed + 1,
                                corruption=s.corruption)
        p = [self.tok.encode(q, add_special_tokens=False) for q, _ in pairs]
        r = [self.tok.encode(a, add_special_tokens=False) + [self.eos] for _, a in pairs]
        P, R = self.cfg.data.max_prompt_length, self.cfg.rollout.response_length
        pid, pm = left_pad(p, P, self.pad)
        rid, rm = right_pad(r, R, self.pad)
        rng = np.random.default_rng(self.cfg.seed + 2)
        m = {}
        for i in range(s.steps):
            if should_stop is not None and should_stop():
                return {}
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
        """Mean score per data_source on the validation set (accuracy for 0/1 rewards).

        `rollout.val_kwargs` sets the samples per prompt n and their temperature (0: greedy,
        the default); `val-core/<source>/acc/mean@n` averages all samples and, for n > 1,
        `val-aux/<source>/acc/best@n` averages each prompt's best sample.
        """
        v = self.cfg.rollout.val_kwargs
        n, temperature = int(v.n), float(v.temperature)
        rows = self.test_data.rows
        # Fixed per-prompt seeds: sampled validation is reproducible and the same at every step.
        batch = self.prompt_batch(rows, np.arange(len(rows), dtype=np.int32))
        out = self.actor.generate(batch, greedy=temperature == 0.0, n=n, temperature=temperature)
        scored = self.reward.compute_reward(out)
        with jax.transfer_guard("allow"):
            scores = np.asarray(jnp.sum(scored["token_level_scores"], axis=1)).reshape(-1, n)
        sources = np.asarray(out.meta["data_source"]).reshape(-1, n)[:, 0]
        metrics = {}
        for ds in sorted(set(sources.tolist())):
            mine = scores[sources == ds]
            metrics[f"val-core/{ds}/acc/mean@{n}"] = float(mine.mean())
            if n > 1:
                metrics[f"val-aux/{ds}/acc/best@{n}"] = float(mine.max(axis=1).mean())
        return metrics

    def train_step(self) -> dict[str, float]:
        """One RL iteration; returns host metrics (the step's one metrics fetch)."""
        c = self.cfg
        if self.workers is None:
            self.workers = self._make_rl_workers()
        w = self.workers
        w.timing.clear()
        rows = next(self.train_iter)
        seeds = (c.seed * 1_000_003 + self.step * 65_537 + np.arange(len(rows))) % (2**31)
        batch = self.prompt_batch(rows, seeds)
        t0 = time.perf_counter()
        batch, metrics = self.algo.step(w, batch, c)
        metrics |= _batch_metrics(dict(batch.arrays), c.rollout.response_length)
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
        host |= w.reward.pop_metrics()
        self.step += 1
        return host

    # -- checkpoints ---------------------------------------------------------------------------

    def ensure_rl_workers(self) -> Workers:
        """The RL worker groups, built on first use (after the warm start)."""
        if self.workers is None:
            self.workers = self._make_rl_workers()
        return self.workers

    def checkpoint_items(self) -> dict[str, Any]:
        """The arrays a checkpoint holds: params and optimizer state of each trained group, and
        the reference's params (saved rather than rebuilt: they are the warm-started actor's)."""
        w = self.ensure_rl_workers()
        items = {"actor_params": w.actor.params, "actor_opt_state": w.actor.opt_state}
        if w.ref is not None:
            items["ref_params"] = w.ref.params
        if w.critic is not None:
            items["critic_params"] = w.critic.params
            items["critic_opt_state"] = w.critic.opt_state
        return items

    def state_dict(self) -> dict:
        """The host state that, with `checkpoint_items()`, fixes every later step (JSON-able).
        Sampling seeds are a function of (seed, step), so the step carries them."""
        w = self.ensure_rl_workers()
        return {
            "step": self.step,
            "seed": self.cfg.seed,
            "data": self._data_state(),
            "kl_ctrl": {"type": type(w.kl_ctrl).__name__, **dataclasses.asdict(w.kl_ctrl)},
            # Update programs shuffle mini-batches with a seed that counts their calls.
            "train_calls": {name: g._train_calls for name, g in
                            (("actor", w.actor), ("critic", w.critic)) if g is not None},
            "model_config": dataclasses.asdict(self.model_cfg),
        }

    def load_state(self, restored: ckpt_lib.Restored) -> None:
        """Installs a restored checkpoint: arrays into the worker groups, host state here."""
        w = self.ensure_rl_workers()
        it, st = restored.items, restored.state
        w.actor.params, w.actor.opt_state = it["actor_params"], it["actor_opt_state"]
        if w.ref is not None:
            w.ref.params = it["ref_params"]
        if w.critic is not None:
            w.critic.params, w.critic.opt_state = it["critic_params"], it["critic_opt_state"]
        self._load_data_state(st["data"])
        kl = dict(st["kl_ctrl"])
        kinds = {"FixedKLController": losses.FixedKLController,
                 "AdaptiveKLController": losses.AdaptiveKLController}
        w.kl_ctrl = kinds[kl.pop("type")](**kl)
        for name, n in st["train_calls"].items():
            getattr(w, name)._train_calls = int(n)
        self.step = int(st["step"])

    def _data_state(self) -> dict:
        return self.train_iter.state()

    def _load_data_state(self, d: dict) -> None:
        try:
            self.train_iter.restore(d)
        except ValueError as err:
            raise ckpt_lib.CheckpointMismatch(str(err)) from None

    @staticmethod
    def resume_source(ckpt: ckpt_lib.RunCheckpointer | None, mode: str = "auto"
                      ) -> tuple[ckpt_lib.RunCheckpointer, int | None] | None:
        """Where `trainer.resume` says to restore from: (checkpointer, step or None for its
        newest), or None for a fresh start. Raises ValueError, before anything is restored or
        written, when the setting contradicts what `ckpt` already holds."""
        mode = str(mode or "auto")
        own = ckpt.steps() if ckpt is not None else []
        if mode == "disable":
            if own:
                raise ValueError(
                    f"trainer.resume=disable, but {ckpt.directory} already holds checkpoints "
                    f"(steps {own}); use trainer.resume=auto to continue that run, or choose "
                    "another trainer.out_dir")
            return None
        if mode == "auto":
            return (ckpt, None) if own else None
        root, step = ckpt_lib.locate(mode)
        if ckpt is not None and root == ckpt.directory:
            return ckpt, step
        if own:
            raise ValueError(
                f"trainer.resume={mode}, but this run's {ckpt.directory} already holds "
                f"checkpoints (steps {own}); choose another trainer.out_dir")
        return ckpt_lib.RunCheckpointer(root, read_only=True), step

    def resume(self, ckpt: ckpt_lib.RunCheckpointer | None,
               mode: str = "auto") -> ckpt_lib.Restored | None:
        """Applies `trainer.resume`:
        - "auto": the newest readable checkpoint in `ckpt`, if it has any;
        - "disable": a fresh start (refused when `ckpt` already holds checkpoints);
        - a path (a run's out_dir, a checkpoint root or one step directory): that checkpoint.
        Returns what was restored, or None for a fresh start."""
        plan = self.resume_source(ckpt, mode)
        if plan is None:
            return None
        source, step = plan
        restored = source.restore_latest(self.checkpoint_items(), step=step)
        self.load_state(restored)
        if source is ckpt:
            # Later steps are corrupt, or were passed over by an explicit step: new saves will
            # reuse their numbers, so move them out of the way.
            later = [s for s in ckpt.steps() if s > restored.step]
            reason = "corrupt" if restored.skipped else "superseded"
            for where in ckpt.set_aside(later, reason=reason):
                logging.warning("moved checkpoint directory aside to %s", where)
        diff = [k for k in ckpt_lib.config_diff(restored.config, config_json(self.cfg))
                if k != "trainer.resume"]
        if diff:
            logging.warning("resuming from a checkpoint saved with a different config: %s",
                            ", ".join(diff))
        return restored

    def save(self, ckpt: ckpt_lib.RunCheckpointer | None) -> None:
        """Starts an async checkpoint of the current step."""
        if ckpt is not None:
            ckpt.save(self.step, self.checkpoint_items(), self.state_dict(),
                      config_json(self.cfg))

    # -- the run -------------------------------------------------------------------------------

    def fit(
        self,
        ckpt: ckpt_lib.RunCheckpointer | None = None,
        logger: MetricsLogger | None = None,
        *,
        resume: str = "auto",
        on_log: Callable | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> FitResult:
        """Runs the job from wherever its checkpoints left it: warm start (logged and saved as
        step 0), validation before training, RL steps with validation every `test_freq` steps
        and at the last step, checkpoints every `save_freq` steps and at the last step.

        When `should_stop()` turns true (SIGTERM), the run stops between steps, saves the
        current step and returns with `preempted` set; during the warm start it stops without
        a checkpoint, and the warm start reruns on the next start.
        """
        t = self.cfg.trainer
        stop = should_stop or (lambda: False)
        logger = logger if logger is not None else MetricsLogger()
        restored = self.resume(ckpt, resume)
        result = FitResult(resumed_from=None if restored is None else restored.step,
                           skipped=[] if restored is None else restored.skipped)
        logger.start(result.resumed_from)
        if ckpt is not None:
            self._save_tokenizer(os.path.dirname(ckpt.directory))
        try:
            if restored is None:
                first = self.warm_start(on_log=on_log, should_stop=stop)
                if stop():
                    result.preempted = True
                    return result
                self.ensure_rl_workers()
                if t.val_before_train:
                    first |= self._timed_validate()
                if first:
                    logger.log(self.step, first)
                if t.save_freq > 0:
                    self.save(ckpt)
            total = t.total_steps
            while self.step < total and not stop():
                m = self.train_step()
                if t.test_freq > 0 and (self.step % t.test_freq == 0 or self.step == total):
                    m |= self._timed_validate()
                logger.log(self.step, m)
                if t.save_freq > 0 and (self.step % t.save_freq == 0 or self.step == total):
                    self.save(ckpt)
            if self.step < total:
                result.preempted = True
                saved = ckpt is None or ckpt.last_saved == self.step or self.step in ckpt.steps()
                if not saved:
                    self.save(ckpt)
        finally:
            if ckpt is not None:
                ckpt.wait()
        result.step = self.step
        return result

    def _timed_validate(self) -> dict[str, float]:
        t0 = time.perf_counter()
        out = self.validate()
        out["timing_s/testing"] = time.perf_counter() - t0
        return out

    def _save_tokenizer(self, out_dir: str) -> None:
        # Export needs the run's tokenizer; it sits next to the checkpoints, written once.
        path = os.path.join(out_dir, "tokenizer")
        if os.path.isdir(path):
            return
        tmp = path + f".tmp-{os.getpid()}"
        self.tok.save(tmp)
        os.replace(tmp, path)


@dataclasses.dataclass
class FitResult:
    """How `Trainer.fit` ended: the step reached, the step it resumed from (None: a fresh
    start), corrupt checkpoints passed over, and whether a stop request cut it short."""

    resumed_from: int | None = None
    skipped: list[str] = dataclasses.field(default_factory=list)
    preempted: bool = False
    step: int = 0


def config_json(cfg) -> dict:
    """The resolved config as plain JSON data."""
    return json.loads(cfg.to_json_best_effort(sort_keys=True))


@functools.partial(jax.jit, static_argnames=("response_length",))
def _batch_metrics(a: dict, response_length: int) -> dict:
    mask = a["response_mask"].astype(jnp.float32)
    score = jnp.sum(a["token_level_scores"], axis=1)
    length = jnp.sum(mask, axis=1)
    out = {
        "critic/score/mean": jnp.mean(score),
        "critic/score/max": jnp.max(score),
        "critic/score/min": jnp.min(score),
        "critic/rewards/mean": jnp.mean(jnp.sum(a["token_level_rewards"], axis=1)),
        "critic/advantages/mean": core.masked_mean(a["advantages"], mask),
        "critic/returns/mean": core.masked_mean(a["returns"], mask),
        "response_length/mean": jnp.mean(length),
        "response_length/max": jnp.max(length),
        # Responses that used every allowed token (cut off, not finished).
        "response_length/clip_ratio": jnp.mean(length >= response_length),
        "_tokens": jnp.sum(a["attention_mask"]).astype(jnp.float32),
    }
    if "values" in a:
        out["critic/values/mean"] = core.masked_mean(a["values"], mask)
    return out

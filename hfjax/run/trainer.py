"""The training loop: builds a run's worker groups from a config, then runs warm start, RL
steps, validation and checkpoints (`Trainer.fit`). It talks to the user only through the metric
sinks and the `on_log` callback that the launcher passes in."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from absl import logging

from hfjax.algorithms import dataflow
from hfjax.algorithms.registry import import_spec
from hfjax.algorithms.spec import StepSpec
from hfjax.config import model_source, run_roles, validate_config
from hfjax.controller import compile_log
from hfjax.controller.async_pools import ROLE as ROLLOUT
from hfjax.data import shapes
from hfjax.data.dataset import task_splits
from hfjax.models import qwen2_5_vl
from hfjax.models.hf_io import read_model_config
from hfjax.numerics import rollout_correction as rc_numerics
from hfjax.parallel import distributed, lost_process, targets
from hfjax.parallel.transfer import host_values
from hfjax.run import checkpoint as ckpt_lib
from hfjax.run import health, mfu, sft
from hfjax.run.async_loop import AsyncRollout
from hfjax.run.metrics import MetricsLogger
from hfjax.run.resume import (
    check_resume,
    checkpoint_items,
    config_json,
    host_state,
    load_state,
)
from hfjax.run.validation import generation_metrics
from hfjax.workers import groups, vision
from hfjax.workers.groups import WorkerGroups
from hfjax.workers.judge import check_vocabulary as check_judge_vocabulary
from hfjax.workers.rollout import build_rollout
from hfjax.workers.teacher import check_vocabulary


class Trainer:
    """Builds the run's worker groups and drives warm start, RL steps and validation."""

    def __init__(self, cfg):
        # Compiles from here on are reported with the metrics of the record they precede
        # (`_with_compiles`): the first RL step's carry the programs it compiled.
        self._compiles = compile_log.install()
        self.algo, self.pools = validate_config(cfg)
        lost_process.name_pools(self.pools)  # a lost process is reported with its pools
        if cfg.model.remat_policy == "auto":
            from hfjax.run.dry_run import resolve_remat

            cfg = resolve_remat(cfg)
        self.cfg, self.spec = cfg, StepSpec.of(cfg)  # the spec: what the algorithm's steps read
        rc = self.spec.algo.rollout_correction
        logging.info("rollout correction: %s%s", rc_numerics.describe(rc.resolved, rc.bypass_mode),
                     " (rollout_is='auto' with async_rollout.max_staleness >= 1; "
                     "--config.algo.rollout_correction.rollout_is=none turns it off)"
                     if cfg.algo.rollout_correction.rollout_is == rc_numerics.AUTO
                     and rc.rollout_is else "")
        self.compute_dtype = model_source.compute_dtype(cfg, jax.devices()[0].platform)
        self.roles = run_roles(self.algo, cfg)
        self.tok = model_source.task_tokenizer(cfg)
        # Bad rows fail or are counted here, before compiling.
        self.train_data, self.test_data = task_splits(cfg, self.tok)
        logging.info("train data: %s", self.train_data.report.summary())
        logging.info("validation data: %s", self.test_data.report.summary())
        # Every process builds its host batches itself (see `train_step`): they must all hold
        # the same config and rows, or their batches would differ without an error.
        distributed.check_same_on_every_process({
            "the config": json.dumps(config_json(cfg), sort_keys=True),
            "the training data": str(self.train_data.fingerprint),
            "the validation data": str(self.test_data.fingerprint),
        })
        self.train_iter = self.train_data.iterator(cfg.data.train_batch_size, seed=cfg.seed)
        self.step = 0
        # Before the model: a custom reward file is imported (under the reward timeout) here.
        self.reward = groups.build_reward(cfg, self.tok,
                                          home=self.pools["actor"].mesh(cfg.actor.mesh))
        initial = model_source.initial_model(cfg, self.tok, self.compute_dtype, self.pools)
        # A vision-language policy: the actor trains its language model, the tower frozen
        # beside it unless actor.freeze_vision is off (docs/vision.md).
        self.vl, tower = None, None
        if isinstance(initial, qwen2_5_vl.VisionLM):
            self.vl = initial.config
            initial, tower = qwen2_5_vl.policy(initial, cfg.actor.freeze_vision)
        self.model_cfg = initial.config
        # Peak dense bf16 FLOP/s of the devices, for perf/mfu/*; None on CPU (no MFU there).
        self._peak = targets.peak_flops(jax.devices()[0].device_kind)
        if self.tok.vocab_size > self.model_cfg.vocab_size:
            raise ValueError(f"the tokenizer has {self.tok.vocab_size} tokens, the model's "
                             f"vocabulary {self.model_cfg.vocab_size}; give a tokenizer that "
                             "fits the model (--config.model.tokenizer)")
        # A teacher or judge of another vocabulary is refused before the warm start, not after.
        if "teacher" in self.roles:
            t = cfg.teacher
            check_vocabulary(t.path, read_model_config(t.path, dtype=t.dtype).vocab_size,
                             self.model_cfg.vocab_size)
        if "judge" in self.roles:
            j = cfg.reward.judge
            check_judge_vocabulary(j.path, read_model_config(j.path, dtype=j.dtype).vocab_size,
                                   self.model_cfg.vocab_size)
        self.actor = groups.build_actor(cfg, initial, self.pools, self.tok.pad_id, self.tok.eos_id,
                                        tokenizer=self.tok, tower=tower, vl=self.vl)
        if rc.bypass_mode and rc.resolved.active:  # rejection inside the policy loss
            self.actor.bypass_rejection = rc.resolved
        self._groups: WorkerGroups | None = None
        self._collapse = health.CollapseWatch(self.model_cfg.vocab_size)
        self._async: AsyncRollout | None = None

    # -- construction ------------------------------------------------------------------------

    @property
    def workers(self) -> WorkerGroups:
        """The RL worker groups, built on first use (after the warm start)."""
        if self._groups is None:
            w = groups.build_groups(self.cfg, self.actor, self.reward, self.roles, self.pools)
            w.next_prompts = self._more_prompts
            self._groups = w
        return self._groups

    # -- stages --------------------------------------------------------------------------------

    def warm_start(self, on_log: Callable | None = None,
                   should_stop: Callable[[], bool] | None = None) -> dict:
        """Supervised steps on `sft.train_files` (SFT parquet) when set, else on the task's
        imperfect demonstrations (the general SFT loop, `hfjax.run.sft.sft_steps`); returns
        the last metrics (empty when `should_stop` ended it early), with
        `sft/nonfinite_updates` counting the steps whose update was not applied
        (NonFiniteError for the first such step under trainer.nonfinite=stop)."""
        s, c = self.cfg.sft, self.cfg
        if s.steps <= 0:
            return {}
        if self.vl is not None and c.data.task == "shapes" and not s.get("train_files"):
            # Demonstrations with pictures (hfjax.data.shapes.sft_texts).
            rows = self.train_data.rows
            batches = vision.sft_batches(
                self.actor, self.tok, rows, shapes.sft_texts(rows, s.corrupt_frac, c.seed + 1),
                batch_size=s.batch_size, steps=s.steps, seed=c.seed + 2,
                max_prompt_length=c.data.max_prompt_length, response_width=sft.response_width(c),
                blank=c.data.blank_images)
            return sft.sft_steps(self.actor, batches, s.steps, s.micro_batch_size, cfg=c,
                                 on_log=on_log, should_stop=should_stop)
        if s.get("train_files"):
            data = sft.parquet_examples(c, self.tok, s.train_files)
        elif c.data.task not in ("arith", "arith_chain", "arith_tool"):
            raise ValueError("sft.steps > 0 needs data.task='arith' (the warm start uses its "
                             "demonstrations) or sft.train_files; set --config.sft.steps=0 for "
                             "other data, and fine-tune on your own data first with python -m "
                             "launch.sft")
        else:
            data = sft.arith_demonstrations(c, self.tok, self.train_data.rows)
        return sft.sft_steps(self.actor, sft.batches_for(c, self.tok, data), s.steps,
                             s.micro_batch_size, cfg=c, on_log=on_log, should_stop=should_stop)

    def validate(self) -> dict[str, float]:
        """Mean score per data_source on the validation set (accuracy for 0/1 rewards).

        Across processes, the scores come back whole to every process (the reward's ON_HOST
        fetch gathers the responses once and every process scores all rows), so every process
        returns the same metrics.

        `rollout.val_kwargs` sets the samples per prompt n and their temperature (0: greedy,
        the default); `val-core/<source>/acc/mean@n` averages all samples and, for n > 1,
        `val-aux/<source>/acc/best@n` averages each prompt's best sample. With reward or cost
        models or a judge, their mean scores on the same responses are reported too
        (`val-aux/...`; the judge's agreement with the rule reward too), and
        `cost_model.reference_fn` checks the cost model against the rule it was trained to
        measure.
        """
        v = self.cfg.rollout.val_kwargs
        w = self._groups
        models = [] if w is None else [g for g in (w.reward_model, w.cost_model) if g]
        ref_fn = self.cfg.cost_model.reference_fn
        return generation_metrics(
            self.actor, self.reward, self.test_data.rows, pad_id=self.tok.pad_id,
            max_prompt_length=self.cfg.data.max_prompt_length, n=int(v.n),
            temperature=float(v.temperature), models=models, tokenizer=self.tok,
            judge=None if w is None else w.roles.get("judge"),
            blank_images=self.cfg.data.blank_images,
            text_metrics={"cost_reference": import_spec(ref_fn)} if ref_fn else None)

    def _prompts(self, rows, attempt: int = 0, step: int | None = None):
        c = self.cfg
        step = self.step if step is None else step
        # Attempt 0 is the step's batch; DAPO's further attempts get seeds of their own.
        seeds = (c.seed * 1_000_003 + step * 65_537 + attempt * 8_191
                 + np.arange(len(rows))) % (2**31)
        return vision.prompts(rows, seeds, self.tok.pad_id, c.data.max_prompt_length, self.tok,
                              self.vl, c.data.blank_images)

    def _more_prompts(self, attempt: int):
        """Another host batch of prompts for the current step (dynamic sampling)."""
        return self._prompts(next(self.train_iter), attempt)

    def _issue(self, step: int):
        """(the host prompts of `step`, the data cursor before drawing them): what the
        asynchronous rollout issues ahead of the trainer."""
        cursor = self.train_iter.state()
        return self._prompts(next(self.train_iter), step=step), cursor

    @property
    def async_rollout(self) -> AsyncRollout | None:
        """The rollout pool's queue when the placement gives the rollout a pool of its own
        (docs/async.md); built on first use, from the actor's weights at that step."""
        if self._async is None and ROLLOUT in self.pools:
            a = self.cfg.async_rollout
            group = build_rollout(self.cfg, self.actor, self.pools[ROLLOUT], self.tok.pad_id,
                                  self.actor.eos_ids, partial_rollout=a.partial_rollout)
            self._async = AsyncRollout(self.actor, group, max_staleness=a.max_staleness,
                                       push_every=a.push_every, start_version=self.step,
                                       prompts=self._issue, partial_rollout=a.partial_rollout)
        return self._async

    def train_step(self) -> dict[str, float]:
        """One RL iteration; returns host metrics (the step's one metrics fetch).

        Across processes, every process draws the same rows (one seeded data order) and builds
        the same small host batch of prompts; placing it on the actor's mesh uploads each
        process's own shards only (`jax.device_put` of a host array onto a sharding that spans
        processes), which gives the array `jax.make_array_from_process_local_data` would build
        from each process's slice (tests/parallel/test_distributed.py checks the two agree).
        The metrics are reduced on the devices and come back whole to every process.
        """
        c, w = self.cfg, self.workers
        w.timing.clear()
        queue = self.async_rollout
        t0 = time.perf_counter()
        if queue is None:
            batch = self._prompts(next(self.train_iter))
        else:
            batch, made = queue.take(self.step)
            w.rollout_source = lambda _prompts: made()
        n_prompts = len(batch)
        try:
            batch, metrics = self.algo.step(w, batch, self.spec)
        finally:
            w.rollout_source = None
        metrics |= dataflow.step_metrics(dict(batch.arrays), self.spec.rollout.response_length)
        if queue is not None:
            metrics |= queue.metrics(self.step, batch)
        host = {k: float(v) for k, v in host_values(metrics).items()}
        if queue is not None:  # the update has finished: its weights go to the rollout pool
            queue.after_update(self.step + 1)
        wall = time.perf_counter() - t0
        # A non-finite KL or cost (from a step whose update is being refused) must not reach
        # the controllers' state, which checkpoints hold.
        if math.isfinite(host.get("actor/reward_kl_penalty", 0.0)):
            w.kl_ctrl = dataflow.update_kl_controller(w.kl_ctrl, host, n_prompts)
        if math.isfinite(host.get("cost/mean", 0.0)):
            w.lagrange = dataflow.update_lagrange(w.lagrange, host)
        host.update(w.timing)
        tokens = host.pop("_tokens")
        host["timing_s/step"] = wall
        host["perf/total_num_tokens"] = tokens
        host["perf/throughput"] = tokens / wall
        response_tokens = host.pop("_response_tokens")
        if w.sync_timing:  # without it the stages' times are dispatch only
            ref = w.ref if w.ref is not None else w.actor
            host |= mfu.step_mfu(
                self.model_cfg, w.timing, rows=len(batch), tokens=tokens,
                response_tokens=response_tokens, epochs=int(c.actor.ppo_epochs),
                actor_devices=w.actor.mesh.devices.size, ref_devices=ref.mesh.devices.size,
                peak=self._peak)
        host["actor/kl_coef"] = float(w.kl_ctrl.value)
        if w.lagrange is not None:
            host["safe_rlhf/lambda"] = float(w.lagrange.value)
        host |= w.reward.pop_metrics()
        for group in w.roles.values():  # a judge's unparsed and timed-out verdicts
            host |= getattr(group, "pop_metrics", dict)()
        host[health.UNIFORM_KEY] = float(self._collapse.observe(host, self.step + 1))
        self.step += 1
        return host

    # -- checkpoints ---------------------------------------------------------------------------

    def checkpoint_items(self) -> dict[str, Any]:
        """The arrays a checkpoint holds (`resume.checkpoint_items`), and with K >= 1 the
        older weights that batches issued ahead were made with (`AsyncRollout.saved_weights`)."""
        items = checkpoint_items(self.workers, self.cfg)
        queue = self._queued_ahead()
        if queue is not None:
            items |= queue.saved_weights(self.step, queue.rollout.params)
        return items

    def _queued_ahead(self) -> AsyncRollout | None:
        """The asynchronous rollout when it issues batches ahead of the trainer (K >= 1)."""
        return self.async_rollout if self.cfg.async_rollout.max_staleness >= 1 else None

    def state_dict(self) -> dict:
        """The host state that, with `checkpoint_items()`, fixes every later step (JSON-able).
        Sampling seeds are a function of (seed, step), so the step carries them."""
        # Batches issued ahead of the trainer and not yet consumed are remade on a resume: the
        # data cursor goes back to the first of them, and the weights they were made with are
        # saved (`checkpoint_items`), so a resumed run makes them again exactly.
        queued = None if self._async is None else self._async.data_state()
        state = host_state(self.workers, self.cfg, step=self.step,
                           data=queued or self.train_iter.state(), model_cfg=self.model_cfg)
        queue = self._queued_ahead()
        return state if queue is None else state | {"async": queue.state(self.step)}

    def load_state(self, restored: ckpt_lib.Restored) -> None:
        """Installs a restored checkpoint: arrays into the worker groups, host state here."""
        self.step = load_state(self.workers, restored, self.train_iter)
        queue = self._queued_ahead()
        if queue is not None:  # a checkpoint without async state: the schedule starts here
            saved = restored.state.get("async", {"start": self.step, "versions": []})
            queue.restore(self.step, saved, restored.items)

    def resume(self, ckpt: ckpt_lib.RunCheckpointer | None,
               mode: str = "auto") -> ckpt_lib.Restored | None:
        """Applies `trainer.resume` (see `checkpoint.resume_source`); returns what was
        restored, or None for a fresh start."""
        if not check_resume(self.cfg, ckpt, mode):
            return None
        source, step = ckpt_lib.resume_source(ckpt, mode)
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

    def close(self) -> None:
        """Ends what the run started beside the controller: the async rollout's thread, the
        tool runner's worker processes (multi-turn rollouts) and the rule reward's scorer
        processes. Training or validating again afterwards starts fresh scorers, but the tools
        stay closed; launch.train closes its trainer at the end, tests in a finalizer."""
        if self._async is not None:
            self._async.close()
        agent = getattr(self.actor, "agent", None)
        if agent is not None:
            agent.close()
        close = getattr(self.reward, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

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
                if t.val_before_train:
                    if any(r in self.roles for r in ("reward_model", "cost_model")):
                        self.workers  # noqa: B018  (built now, so step 0 reports their scores)
                    first |= self._timed_validate()
                if first:
                    logger.log(self.step, self._with_compiles(first))
                if t.save_freq > 0:
                    self.save(ckpt)
            total = t.total_steps
            while self.step < total and not stop():
                m = self.train_step()
                # A step that stops the run is logged first, so metrics.jsonl shows it.
                stopping = health.must_stop(m, self.cfg)
                if not stopping and t.test_freq > 0 and (self.step % t.test_freq == 0
                                                         or self.step == total):
                    m |= self._timed_validate()
                logger.log(self.step, self._with_compiles(m))
                health.check_nonfinite(m, f"RL step {self.step}", self.cfg)
                if t.save_freq > 0 and (self.step % t.save_freq == 0 or self.step == total):
                    self.save(ckpt)
            if self.step < total:
                result.preempted = True
                saved = ckpt is None or ckpt.last_saved == self.step or self.step in ckpt.steps()
                if not saved:
                    self.save(ckpt)
        finally:
            if self._async is not None:
                self._async.close()
            if ckpt is not None:
                ckpt.wait()
        result.step = self.step
        return result

    def _with_compiles(self, m: dict[str, float]) -> dict[str, float]:
        """`m` with the compiles since the previous record (`compile_log.metrics`), listed in
        the log when there were any."""
        records = self._compiles.take()
        if records.compiles:
            logging.info("step %d compiled %d programs in %.1f s (tracing and lowering %.1f s):"
                         "\n%s", self.step, len(records.compiles),
                         sum(c.seconds for c in records.compiles), records.trace_s,
                         "\n".join(compile_log.summary(records)))
        return m | compile_log.metrics(records)

    def _timed_validate(self) -> dict[str, float]:
        t0 = time.perf_counter()
        with compile_log.stage("testing"):
            out = self.validate()
        out["timing_s/testing"] = time.perf_counter() - t0
        return out

    def _save_tokenizer(self, out_dir: str) -> None:
        # Export needs the run's tokenizer; it sits next to the checkpoints, written once (by
        # process 0: the processes of a run share out_dir).
        path = os.path.join(out_dir, "tokenizer")
        if os.path.isdir(path) or not distributed.is_main_process():
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

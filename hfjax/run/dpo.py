"""Offline preference optimisation of a policy: DPO and its relatives on preference pairs.

`DPOTrainer` is what `python -m launch.train_dpo` runs. Its dataflow, over two worker groups:

    policy = actor (model.path, or a fresh model), warm-started by SFT when sft.steps > 0
    ref    = a frozen copy of it on the `ref` pool (placement), ref.mesh
    ref log-probs of every pair's chosen and rejected response: once, cached on the host
    repeat dpo.steps times: policy update on dpo.batch_size pairs with the loss dpo.loss_type

The data is the preference parquet `launch.train_rm` reads (`hfjax.data.preferences`); the
loss is one of `hfjax.numerics.preference.PREFERENCE_LOSSES` (a reference-free one builds no
reference). Log-probs are of the model's own distribution (temperature 1) over the response
tokens. The run reports TRL's metrics (`rewards/chosen`, `rewards/rejected`,
`rewards/accuracies`, `rewards/margins`, `logps/chosen`, `logps/rejected`) on training batches
and, under `val/`, on the held-out pairs (`dpo.val_files`), and for the embedded task the
held-out accuracy by greedy generation, before and after; it writes the policy as an HF
directory that `launch.train` starts from.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from hfjax.config import model_source
from hfjax.controller.batch import Batch
from hfjax.controller.placement import resolve_placement
from hfjax.data import holdout, preferences
from hfjax.data.dataset import task_splits
from hfjax.engine.update import make_optimizer
from hfjax.models import save_hf
from hfjax.numerics.preference import PREFERENCE_LOSSES, PreferenceInputs, needs_reference
from hfjax.parallel.transfer import to_host
from hfjax.run import sft
from hfjax.run.validation import generation_metrics
from hfjax.workers import groups
from hfjax.workers.actor import Reference
from hfjax.workers.logprobs import response_logprobs

SIDES = ("chosen", "rejected")
ARITH_TASKS = ("arith", "arith_chain")


def _pair_count(batch):
    return {"pairs": jnp.float32(batch["chosen_ids"].shape[0])}


def preference_metrics(losses, chosen_rewards, rejected_rewards, chosen_logps, rejected_logps,
                       pairs) -> dict:
    """TRL's DPO metrics, each a sum over the rows given divided by `pairs` (so that micro-
    batches' metrics add up to the mini-batch's means)."""
    sg = jax.lax.stop_gradient
    rc, rr = sg(chosen_rewards), sg(rejected_rewards)
    return {"dpo/loss": jnp.sum(sg(losses)) / pairs,
            "rewards/chosen": jnp.sum(rc) / pairs,
            "rewards/rejected": jnp.sum(rr) / pairs,
            "rewards/accuracies": jnp.sum((rc > rr).astype(jnp.float32)) / pairs,
            "rewards/margins": jnp.sum(rc - rr) / pairs,
            "logps/chosen": jnp.sum(sg(chosen_logps)) / pairs,
            "logps/rejected": jnp.sum(sg(rejected_logps)) / pairs}


class DPOTrainer:
    """Builds the policy, its reference and the preference data of a DPO run from a config
    (module docstring) and trains it."""

    def __init__(self, cfg):
        self.cfg = c = cfg
        d = c.dpo
        self.loss = PREFERENCE_LOSSES.get(d.loss_type)  # an unknown name lists the known ones
        if d.steps <= 0:
            raise ValueError(f"dpo.steps={d.steps}: training needs at least one step")
        if c.rollout.temperature != 1.0:
            raise ValueError(f"rollout.temperature={c.rollout.temperature}: DPO scores the "
                             "model's own distribution; set --config.rollout.temperature=1.0")
        if not d.train_files:
            raise ValueError("dpo.train_files is empty; write preference parquet with python -m "
                             "launch.prepare_data --task=arith_prefs, or point it at your own "
                             "(columns prompt, chosen, rejected)")
        self.tok = model_source.task_tokenizer(c)
        self.width = (c.data.max_prompt_length,
                      int(d.max_response_length or c.rollout.response_length))
        kw = dict(max_prompt_length=self.width[0], max_response_length=self.width[1])
        self.train = preferences.load_parquet(d.train_files.split(","), self.tok, **kw)
        self.val = (preferences.load_parquet(d.val_files.split(","), self.tok, **kw)
                    if d.val_files else None)
        allow = bool(c.data.get("allow_overlap", False))
        train_prompts = [p.prompt_ids for p in self.train.pairs]
        if self.val is not None:
            holdout.check_disjoint(train_prompts, (p.prompt_ids for p in self.val.pairs),
                                   "dpo.val_files against dpo.train_files",
                                   "data.allow_overlap=True", allow=allow)
        self.task_rows, self.prompt_rows = [], []
        if c.data.task in ARITH_TASKS:
            train_split, test_split = task_splits(c, self.tok)
            self.task_rows, self.prompt_rows = train_split.rows, test_split.rows
            # Held-out accuracy is of prompts no training pair asks.
            holdout.check_disjoint(train_prompts,
                                   (tuple(r["prompt_ids"]) for r in self.prompt_rows),
                                   "the task's held-out prompts against dpo.train_files",
                                   "data.allow_overlap=True", allow=allow)
        logging.info("preference data: %s", self.train.summary())
        roles = ("actor", "ref") if needs_reference(d.loss_type) else ("actor",)
        self.pools = resolve_placement(c.placement, roles, jax.devices())
        compute = model_source.compute_dtype(c, jax.devices()[0].platform)
        model = model_source.initial_model(c, self.tok, compute, self.pools)
        self.actor = groups.build_actor(c, model, self.pools, self.tok.pad_id, self.tok.eos_id,
                                        tokenizer=self.tok)
        dp = self.actor.dp_size
        if d.batch_size % d.micro_batch_size or d.micro_batch_size % dp:
            raise ValueError(f"dpo.batch_size={d.batch_size} must be a multiple of "
                             f"dpo.micro_batch_size={d.micro_batch_size}, itself a multiple of "
                             f"the actor's data-parallel size {dp}")
        if d.batch_size > len(self.train.pairs):
            raise ValueError(f"dpo.batch_size={d.batch_size} is larger than the "
                             f"{len(self.train.pairs)} training pairs")
        self.reward = (groups.build_reward(c, self.tok, home=self.actor.mesh)
                       if self.prompt_rows else None)
        self.ref: Reference | None = None
        # "train" / "val" -> the reference's summed log-probs of each side (`cache_reference`)
        self._ref_logps: dict[str, dict[str, np.ndarray]] = {}

    # -- data and scoring ------------------------------------------------------------------

    def arrays(self, split: str) -> Batch:
        """Host Batch of every pair of `split` ("train" or "val"): per side `<side>_ids`,
        `<side>_mask` [N, P + R] and `<side>_loss_mask` [N, R] (the response tokens), and the
        reference's summed log-probs `ref_<side>_logps` [N] (zeros for a reference-free
        loss)."""
        data = self.train if split == "train" else self.val
        pairs = data.arrays(prompt_width=self.width[0], response_width=self.width[1],
                            pad_id=self.tok.pad_id)
        out = dict(pairs.arrays)
        for side in SIDES:
            out[f"{side}_loss_mask"] = out[f"{side}_mask"][:, self.width[0]:]
        out |= self._ref_logps.get(split) or {
            f"ref_{side}_logps": np.zeros(len(data.pairs), np.float32) for side in SIDES}
        return Batch(out)

    def _sequence_logps(self, compute, data: preferences.PreferenceData,
                        key: str) -> dict[str, np.ndarray]:
        """Summed response log-probs [N] of each side of `data`'s pairs by a worker group's
        `compute(batch)` (per-token log-probs under `key`), in parts of dpo.batch_size
        pairs."""
        pairs = data.arrays(prompt_width=self.width[0], response_width=self.width[1],
                            pad_id=self.tok.pad_id)
        out = {}
        for side in SIDES:
            parts = []
            for chunk in pairs.split(max(self.cfg.dpo.batch_size, 1)):
                ids, mask = chunk[f"{side}_ids"], chunk[f"{side}_mask"]
                lp = to_host(compute(Batch({"input_ids": ids, "attention_mask": mask,
                                            "responses": ids[:, self.width[0]:]}))[key])
                parts.append(np.sum(lp * mask[:, self.width[0]:], axis=1))
            out[side] = np.concatenate(parts).astype(np.float32)
        return out

    def cache_reference(self) -> None:
        """The reference's log-probs of every training and held-out pair, computed once by
        the `ref` worker group (a frozen copy of the policy as it is now, on the ref pool),
        which is then released."""
        if not needs_reference(self.cfg.dpo.loss_type):
            return
        c = self.cfg
        self.ref = Reference("ref", self.pools["ref"], c.ref.mesh, self.actor.model(),
                             home=self.actor.mesh, sequence_parallel=c.ref.sequence_parallel,
                             spec=self.actor.spec, rollout=self.actor.rollout)
        for split, data in (("train", self.train), ("val", self.val)):
            if data is not None:
                lp = self._sequence_logps(self.ref.compute_ref_log_prob, data, "ref_log_prob")
                self._ref_logps[split] = {f"ref_{s}_logps": lp[s] for s in SIDES}
        self.ref = None  # its weights are not needed again

    # -- the update --------------------------------------------------------------------------

    def _loss(self, params, mb, totals):
        d, a = self.cfg.dpo, self.actor
        model = a.model(params)
        logps, tokens = {}, {}
        for side in SIDES:
            mask = mb[f"{side}_loss_mask"]
            lp, _ = response_logprobs(model, mb[f"{side}_ids"], mb[f"{side}_mask"],
                                      mask.shape[1], 1.0, chunk=a.chunk, dp=a.dp_size)
            logps[side] = jnp.sum(lp * mask, axis=1)
            tokens[side] = jnp.sum(mask, axis=1).astype(jnp.float32)
        losses, rc, rr = self.loss(PreferenceInputs(
            logps["chosen"], logps["rejected"], mb["ref_chosen_logps"], mb["ref_rejected_logps"],
            tokens["chosen"], tokens["rejected"], beta=d.beta, label_smoothing=d.label_smoothing,
            gamma=d.simpo_gamma))
        pairs = totals["pairs"]
        return jnp.sum(losses) / pairs, preference_metrics(
            losses, rc, rr, logps["chosen"], logps["rejected"], pairs)

    def update(self, batch: Batch) -> dict[str, jax.Array]:
        """One optimizer step on the pairs of host `batch` (`arrays` rows), in micro-batches of
        dpo.micro_batch_size pairs; returns the step's metrics (device scalars)."""
        keys = [f"{p}{side}{s}" for side in SIDES for p, s in
                (("", "_ids"), ("", "_mask"), ("", "_loss_mask"), ("ref_", "_logps"))]
        m = self.actor.train(self._loss, batch, keys, mini=len(batch),
                             micro=self.cfg.dpo.micro_batch_size, epochs=1, shuffle=False,
                             normalisers=_pair_count)
        m.pop("loss")
        m["dpo/grad_norm"] = m.pop("grad_norm")
        m["dpo/nonfinite_updates"] = m.pop("nonfinite")
        m["dpo/nonfinite_params"] = m.pop("nonfinite_params")
        return m

    # -- evaluation and the loop -------------------------------------------------------------

    def evaluate(self) -> dict[str, float]:
        """The preference metrics on the held-out pairs (`val/...`), and for the embedded task
        the held-out accuracy by greedy generation."""
        out = {}
        if self.val is not None:
            pol = self._sequence_logps(self.actor.compute_log_prob, self.val, "old_log_probs")
            val = self.arrays("val")
            n = {s: np.sum(val[f"{s}_loss_mask"], axis=1).astype(np.float32) for s in SIDES}
            d = self.cfg.dpo
            losses, rc, rr = self.loss(PreferenceInputs(
                pol["chosen"], pol["rejected"], val["ref_chosen_logps"],
                val["ref_rejected_logps"], n["chosen"], n["rejected"], beta=d.beta,
                label_smoothing=d.label_smoothing, gamma=d.simpo_gamma))
            m = preference_metrics(losses, rc, rr, pol["chosen"], pol["rejected"],
                                   float(len(self.val.pairs)))
            out |= {f"val/{k}": float(v) for k, v in m.items()}
        if self.prompt_rows:
            out |= generation_metrics(self.actor, self.reward, self.prompt_rows,
                                      pad_id=self.tok.pad_id,
                                      max_prompt_length=self.cfg.data.max_prompt_length)
        return out

    def warm_start(self) -> dict:
        """sft.steps supervised steps (the default job's warm start) before DPO: on
        sft.train_files, or the embedded task's demonstrations."""
        c = self.cfg
        if c.sft.steps <= 0:
            return {}
        if c.sft.get("train_files"):
            data = sft.parquet_examples(c, self.tok, c.sft.train_files)
        elif self.task_rows:
            data = sft.arith_demonstrations(c, self.tok, self.task_rows)
        else:
            raise ValueError("sft.steps > 0 needs data.task='arith' or sft.train_files; set "
                             "--config.sft.steps=0 to start DPO from model.path as it is")
        return sft.sft_steps(self.actor, sft.batches_for(c, self.tok, data), c.sft.steps,
                             c.sft.micro_batch_size, cfg=c, step_name="warm-start step")

    def fit(self, on_log: Callable | None = None,
            should_stop: Callable[[], bool] | None = None) -> dict:
        """Warm start, reference log-probs, evaluation, `dpo.steps` steps of `dpo.batch_size`
        pairs (drawn without replacement within a step) with an evaluation every
        `dpo.eval_every` steps, evaluation; returns {"before", "after", "last", "history",
        "wall_s"}."""
        d = self.cfg.dpo
        t0 = time.perf_counter()
        self.warm_start()
        self.actor.set_optimizer(make_optimizer(d.lr, weight_decay=d.weight_decay,
                                                grad_clip=d.grad_clip))
        self.cache_reference()
        before = self.evaluate()
        pairs = self.arrays("train")
        rng = np.random.default_rng(self.cfg.seed + 5)
        history, m = [], {}
        for i in range(d.steps):
            if should_stop is not None and should_stop():
                break
            m = self.update(pairs.take(rng.choice(len(pairs), d.batch_size, replace=False)))
            if d.eval_every and (i + 1) % d.eval_every == 0:
                row = {"step": i + 1, **{k: float(v) for k, v in jax.device_get(m).items()},
                       **self.evaluate()}
                history.append(row)
                if on_log:
                    on_log(i + 1, row)
        last = {k: float(v) for k, v in jax.device_get(m).items()}
        return {"before": before, "after": self.evaluate(), "last": last, "history": history,
                "wall_s": time.perf_counter() - t0}

    def save(self, out_dir: str) -> str:
        """Writes the policy and its tokenizer as an HF directory; returns it."""
        os.makedirs(os.path.dirname(os.path.abspath(out_dir)), exist_ok=True)
        return save_hf(self.actor.model(), out_dir, tokenizer=self.tok)


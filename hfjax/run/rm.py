"""Reward- and cost-model training: a `ScoreModel` trained with the Bradley–Terry loss on
preference pairs (`hfjax.data.preferences`), reporting pairwise accuracy on held-out pairs.

`RMTrainer` is what `python -m launch.train_rm` runs. The model starts from `model.path` (a
causal LM, e.g. the SFT policy, whose trunk it keeps under a fresh score head; or a reward model
to train further) or from a fresh tiny model. `rm.target="cost"` trains a cost model: it scores
the rejected (costlier) response above the chosen one, and with `rm.sign_coef` > 0 and the
data's unsafe labels it also learns to put costly responses above 0 (Safe-RLHF's cost model).
The result is written as an HF `*ForSequenceClassification` directory, which `reward_model.path`
/ `cost_model.path` of an RL run load.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import jax
import numpy as np
from absl import logging

from hfjax.config import model_source
from hfjax.controller.batch import Batch
from hfjax.controller.placement import resolve_placement
from hfjax.data import arith, holdout, preferences
from hfjax.engine.update import make_optimizer
from hfjax.models import load as load_model
from hfjax.models import load_tokenizer, save_hf, transformer
from hfjax.models.config import scratch_model_config
from hfjax.parallel.mesh import MeshSpec, dp_size
from hfjax.parallel.transfer import to_host
from hfjax.workers.score import ModelReward


class RMTrainer:
    """Builds a reward (or cost) model and its preference data from a config and trains it."""

    def __init__(self, cfg):
        self.cfg = c = cfg
        r = c.rm
        if r.target not in preferences.TARGETS:
            raise ValueError(f"rm.target={r.target!r}; use one of {preferences.TARGETS}")
        if r.steps <= 0:
            raise ValueError(f"rm.steps={r.steps}: training needs at least one step")
        self.tok = load_tokenizer(c.model.path) if c.model.path else arith.tokenizer()
        self.width = (c.data.max_prompt_length, int(r.max_response_length
                                                    or c.rollout.response_length))
        kw = dict(max_prompt_length=self.width[0], max_response_length=self.width[1])
        if not r.train_files:
            raise ValueError("rm.train_files is empty; write preference parquet with python -m "
                             "launch.prepare_data --task=arith_prefs (or arith_cost_prefs), or "
                             "point it at your own (columns prompt, chosen, rejected)")
        self.train = preferences.load_parquet(r.train_files.split(","), self.tok, **kw)
        self.val = (preferences.load_parquet(r.val_files.split(","), self.tok, **kw)
                    if r.val_files else None)
        if self.val is not None:
            # Held-out pairs ask prompts no training pair asks (rendered ids compared).
            holdout.check_disjoint((p.prompt_ids for p in self.train.pairs),
                                   (p.prompt_ids for p in self.val.pairs),
                                   "rm.val_files against rm.train_files",
                                   "data.allow_overlap=True",
                                   allow=bool(c.data.get("allow_overlap", False)))
        if r.sign_coef and not self.train.labelled:
            raise ValueError("rm.sign_coef > 0 needs chosen_unsafe / rejected_unsafe labels in "
                             "every training pair; set rm.sign_coef=0 or label the data")
        logging.info("preference data: %s", self.train.summary())
        pools = resolve_placement("colocate", ("reward_model",), jax.devices())
        pool = pools["reward_model"]
        dp = dp_size(MeshSpec.parse(r.mesh).build(pool.devices, "reward_model"))
        if r.batch_size % r.micro_batch_size or r.micro_batch_size % dp:
            raise ValueError(f"rm.batch_size={r.batch_size} must be a multiple of "
                             f"rm.micro_batch_size={r.micro_batch_size}, itself a multiple of "
                             f"the data-parallel size {dp}")
        if r.batch_size > len(self.train.pairs):
            raise ValueError(f"rm.batch_size={r.batch_size} is larger than the "
                             f"{len(self.train.pairs)} training pairs")
        self.group = ModelReward(
            "reward_model" if r.target == "reward" else "cost_model", pool, r.mesh,
            self._initial_model(), output="scores", sign_coef=r.sign_coef,
            center_coef=r.center_coef,
            optimizer=make_optimizer(r.lr, weight_decay=r.weight_decay, grad_clip=r.grad_clip))

    def _initial_model(self):
        """The model before training, its weights in `model.param_dtype` and its compute in
        `model.dtype` resolved for this platform as an RL run resolves it (`auto`)."""
        c = self.cfg
        compute = model_source.compute_dtype(c, jax.devices()[0].platform)
        if c.model.path:
            # A causal LM gives the trunk (its head starts fresh); a score model continues.
            return load_model(c.model.path, head="score",
                              **model_source.model_overrides(c, compute))
        mcfg = scratch_model_config(c.model, self.tok.vocab_size, self.tok.pad_id,
                                    self.tok.eos_id, sum(self.width), compute)
        return transformer.build(mcfg, "score", seed=c.seed)

    def _arrays(self, data: preferences.PreferenceData) -> Batch:
        return data.arrays(prompt_width=self.width[0], response_width=self.width[1],
                           pad_id=self.tok.pad_id, target=self.cfg.rm.target)

    def scores(self, data: preferences.PreferenceData) -> tuple[np.ndarray, np.ndarray]:
        """Host scores [N] of the pairs' (chosen, rejected) sides under the current model, in
        the order of the training target (for a cost model, the costlier side first)."""
        pairs = self._arrays(data)
        out = []
        for side in ("chosen", "rejected"):
            part = []
            for chunk in pairs.split(max(self.cfg.rm.batch_size, 1)):
                s = self.group.compute_score(Batch({"input_ids": chunk[f"{side}_ids"],
                                                    "attention_mask": chunk[f"{side}_mask"]}))
                part.append(to_host(s["scores"]))
            out.append(np.concatenate(part))
        return out[0], out[1]

    def evaluate(self, data: preferences.PreferenceData | None = None) -> dict[str, float]:
        """Pairwise accuracy on held-out pairs (the share ranked the right way, ties wrong),
        the mean margin, and with unsafe labels the share of responses on the right side of 0."""
        data = data or self.val
        if data is None:
            return {}
        first, second = self.scores(data)
        out = {"val/pairwise_accuracy": float(np.mean(first > second)),
               "val/margin": float(np.mean(first - second))}
        if data.labelled:
            signs = self._arrays(data)
            right = np.concatenate([np.sign(first) == signs["chosen_sign"],
                                    np.sign(second) == signs["rejected_sign"]])
            out["val/sign_accuracy"] = float(np.mean(right))
        return out

    def fit(self, on_log: Callable | None = None,
            should_stop: Callable[[], bool] | None = None) -> dict:
        """Evaluates, trains `rm.steps` steps of `rm.batch_size` pairs (drawn without
        replacement within a batch), evaluating every `rm.eval_every` steps; returns
        {"before", "after", "last", "history", "wall_s"}."""
        r = self.cfg.rm
        t0 = time.perf_counter()
        before = self.evaluate()
        pairs = self._arrays(self.train)
        rng = np.random.default_rng(self.cfg.seed + 3)
        history, m = [], {}
        for i in range(r.steps):
            if should_stop is not None and should_stop():
                break
            idx = rng.choice(len(pairs), r.batch_size, replace=False)
            m = self.group.update_pairwise(Batch({k: v[idx] for k, v in pairs.arrays.items()}),
                                           r.micro_batch_size)
            if r.eval_every and (i + 1) % r.eval_every == 0:
                row = {"step": i + 1, **{k: float(v) for k, v in jax.device_get(m).items()},
                       **self.evaluate()}
                history.append(row)
                if on_log:
                    on_log(i + 1, row)
        last = {k: float(v) for k, v in jax.device_get(m).items()}
        return {"before": before, "after": self.evaluate(), "last": last, "history": history,
                "wall_s": time.perf_counter() - t0}

    def save(self, out_dir: str) -> str:
        """Writes the model and its tokenizer as an HF *ForSequenceClassification directory."""
        os.makedirs(os.path.dirname(os.path.abspath(out_dir)), exist_ok=True)
        return save_hf(self.group.model(), out_dir, tokenizer=self.tok)

"""Supervised fine-tuning: a policy trained by cross-entropy on the response tokens of
(prompt, response) examples (`hfjax.data.sft`), on any mesh.

`sft_steps` is the loop every SFT in hfjax runs, the RL trainer's warm start included.
`SFTTrainer` is what `python -m launch.sft` runs: it builds the policy (from `model.path` or a
fresh tiny model), the training examples (SFT parquet in `sft.train_files`, or the embedded
task's demonstrations), trains, measures held-out loss (and, when the run has prompt rows with
rule rewards, held-out accuracy by generation) before and after, and writes the policy as an HF
directory that `launch.train` starts from (`--config.model.path=<out_dir>/hf`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator

import jax
import numpy as np
from absl import logging

from hfjax.config import model_source
from hfjax.controller.batch import Batch
from hfjax.data import arith, holdout, tool_arith
from hfjax.data import sft as sft_data
from hfjax.data.batching import sft_arrays, sft_batches
from hfjax.data.dataset import task_dataset, task_splits
from hfjax.models import save_hf
from hfjax.parallel.mesh import dp_size
from hfjax.run import health
from hfjax.run.validation import generation_metrics, policy_alone
from hfjax.workers import groups

# Steps between checks for non-finite updates (each check is one small fetch).
SFT_CHECK_EVERY = 100


def sft_steps(policy, batches: Iterator[Batch], steps: int, micro: int, *, cfg,
              on_log: Callable | None = None, should_stop: Callable[[], bool] | None = None,
              log_every: int = SFT_CHECK_EVERY, step_name: str = "warm-start step") -> dict:
    """`steps` supervised updates of `policy` (an actor worker group) on host batches from
    `batches`, in micro-batches of `micro` sequences; `on_log(step, metrics)` every
    `log_every` steps. Returns the last step's metrics as floats (empty when `should_stop`
    ended it early or steps is 0), with `sft/nonfinite_updates` counting the steps whose update
    was not applied.

    Non-finite updates are checked every `log_every` steps and at the end (one fetch of those
    steps' metrics each time), and raise NonFiniteError naming the first such step (as
    `step_name` N) under `cfg.trainer.nonfinite`=stop (`hfjax.run.health`)."""
    m, pending, skipped = {}, [], 0
    for i in range(steps):
        if should_stop is not None and should_stop():
            return {}
        m = policy.update_sft(next(batches), micro)
        pending.append(m)
        if (i + 1) % log_every == 0 or i + 1 == steps:
            skipped += _check_nonfinite(pending, i + 1 - len(pending), cfg, step_name)
            pending = []
            if on_log and (i + 1) % log_every == 0:
                on_log(i + 1, {k: float(v) for k, v in jax.device_get(m).items()})
    if not m:
        return {}
    out = {k: float(v) for k, v in jax.device_get(m).items()}
    out["sft/nonfinite_updates"] = float(skipped)
    return out


def _check_nonfinite(steps: list[dict], first: int, cfg, step_name: str) -> int:
    """How many of the SFT steps after step `first` (their metrics) did not apply their update
    (one fetch); NonFiniteError for the first such step under trainer.nonfinite=stop."""
    with jax.transfer_guard("allow"):
        host = jax.device_get(steps)
    bad = [(first + k + 1, m) for k, m in enumerate(host)
           if m["sft/nonfinite_updates"] or m["sft/nonfinite_params"]]
    if bad:
        step, m = bad[0]
        health.check_nonfinite({k: float(v) for k, v in m.items()}, f"{step_name} {step}", cfg)
        logging.warning("%s: %d updates with non-finite numbers skipped (the first at %s %d)",
                        step_name, len(bad), step_name, step)
    return len(bad)


def arith_demonstrations(cfg, tok, rows) -> sft_data.SFTData:
    """The embedded task's deliberately imperfect demonstrations (`sft.corruption`) for
    `rows`, as SFT examples."""
    s = cfg.sft
    if cfg.data.task == "arith_tool":
        # Imperfect tool use: a fraction corrupt_frac of the demonstrations skip the tool.
        return tool_arith.demonstrations(tok, rows, 1.0 - s.corrupt_frac, seed=cfg.seed + 1)
    pairs = arith.sft_texts(rows, s.corrupt_frac, seed=cfg.seed + 1, corruption=s.corruption,
                            scratchpad_lines=s.get("scratchpad_lines", 0))
    return sft_data.from_texts(tok, pairs, source="arith demonstrations")


def parquet_examples(cfg, tok, files: str) -> sft_data.SFTData:
    """The SFT examples of comma-separated SFT parquet `files`, with the run's lengths and
    column names."""
    c, s = cfg, cfg.sft
    return sft_data.load_parquet(files.split(","), tok, max_prompt_length=c.data.max_prompt_length,
                                 max_response_length=response_width(c), prompt_key=s.prompt_key,
                                 response_key=s.response_key, messages_key=s.messages_key)


def batches_for(cfg, tok, data: sft_data.SFTData) -> Iterator[Batch]:
    """The run's SFT batches of `data` (`sft.batch_size` examples, `sft.steps` of them)."""
    c, s = cfg, cfg.sft
    prompts, responses, masks = data.arrays()
    full = all(all(m) for m in masks)  # plain pairs: every response token is learned
    return sft_batches(prompts, responses, prompt_width=c.data.max_prompt_length,
                       response_width=response_width(cfg), pad_id=tok.pad_id,
                       batch_size=s.batch_size, steps=s.steps, seed=c.seed + 2,
                       loss_masks=None if full else masks)


def response_width(cfg) -> int:
    """The response columns of an SFT batch: `sft.max_response_length`, or the RL response
    length when that is 0."""
    return int(cfg.sft.get("max_response_length", 0) or cfg.rollout.response_length)


class SFTTrainer:
    """Builds the policy and the data of an SFT run (module docstring) and trains it."""

    def __init__(self, cfg):
        self.cfg = c = cfg
        s = c.sft
        if s.steps <= 0:
            raise ValueError(f"sft.steps={s.steps}: an SFT run needs at least one step")
        self.tok = model_source.task_tokenizer(c)
        self.prompt_rows = []  # held-out prompts with rule rewards, for generation accuracy
        if s.get("train_files"):
            self.train = parquet_examples(c, self.tok, s.train_files)
            self.val = parquet_examples(c, self.tok, s.val_files) if s.get("val_files") else None
            if c.data.task == "parquet" and c.data.val_files and s.heldout_generation:
                self.prompt_rows = task_dataset(c, self.tok, "test").rows
                # The demonstrations' prompts against the held-out prompts, as rendered ids.
                holdout.check_disjoint(
                    (e.prompt_ids for e in self.train.examples),
                    (tuple(r["prompt_ids"]) for r in self.prompt_rows),
                    "data.val_files against sft.train_files", "data.allow_overlap=True",
                    allow=bool(c.data.get("allow_overlap", False)))
        elif c.data.task in ("arith", "arith_chain", "arith_tool"):
            train, test = task_splits(c, self.tok)
            self.train = arith_demonstrations(c, self.tok, train.rows)
            self.val = arith_demonstrations(c, self.tok, test.rows)
            self.prompt_rows = test.rows if s.heldout_generation else []
        else:
            raise ValueError("an SFT run needs sft.train_files (SFT parquet), or data.task="
                             "'arith' for the embedded task's demonstrations")
        logging.info("SFT data: %s", self.train.summary())
        self.pools, self.actor = policy_alone(c, self.tok)
        self.reward = (groups.build_reward(c, self.tok, home=self.actor.mesh)
                       if self.prompt_rows else None)

    def heldout_loss(self) -> float | None:
        """Mean NLL per loss-masked token of the held-out examples (None without any)."""
        if self.val is None:
            return None
        prompts, responses, masks = self.val.arrays()
        batch = sft_arrays(prompts, responses, prompt_width=self.cfg.data.max_prompt_length,
                           response_width=response_width(self.cfg), pad_id=self.tok.pad_id,
                           loss_masks=masks)
        # Padding rows repeat real rows and would count twice: pad with loss-free rows instead.
        dp = dp_size(self.actor.mesh)
        pad = -len(batch) % dp
        if pad:
            extra = batch.index(slice(0, pad))
            batch = Batch.concat([batch, Batch(
                {**extra.arrays, "response_mask": np.zeros_like(extra["response_mask"])})])
        nll, tokens = 0.0, 0.0
        # Parts of a multiple of dp rows, so that dispatch adds no padding of its own.
        for part in batch.split(dp * max(1, self.cfg.sft.batch_size // dp)):
            m = jax.device_get(self.actor.compute_sft_nll(part))
            nll, tokens = nll + float(m["nll"]), tokens + float(m["tokens"])
        return nll / max(tokens, 1.0)

    def evaluate(self) -> dict[str, float]:
        """Held-out loss and, with prompt rows, held-out accuracy by greedy generation."""
        out = {}
        loss = self.heldout_loss()
        if loss is not None:
            out["val/sft_loss"] = loss
        if self.prompt_rows:
            out |= generation_metrics(self.actor, self.reward, self.prompt_rows,
                                      pad_id=self.tok.pad_id,
                                      max_prompt_length=self.cfg.data.max_prompt_length)
        return out

    def fit(self, on_log: Callable | None = None,
            should_stop: Callable[[], bool] | None = None) -> dict:
        """Evaluates, trains `sft.steps` steps, evaluates again; returns {"before", "after",
        "last" (the last step's metrics), "wall_s"}."""
        t0 = time.perf_counter()
        before = self.evaluate()
        last = sft_steps(self.actor, batches_for(self.cfg, self.tok, self.train),
                         self.cfg.sft.steps, self.cfg.sft.micro_batch_size, cfg=self.cfg,
                         on_log=on_log, should_stop=should_stop, step_name="SFT step")
        after = self.evaluate()
        return {"before": before, "after": after, "last": last,
                "wall_s": time.perf_counter() - t0}

    def save(self, out_dir: str) -> str:
        """Writes the policy and its tokenizer as an HF directory; returns it."""
        os.makedirs(os.path.dirname(os.path.abspath(out_dir)), exist_ok=True)
        return save_hf(self.actor.model(), out_dir, tokenizer=self.tok)

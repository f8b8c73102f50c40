"""Runs an RL job from an ml_collections config.

    python -m launch.train                                   # the default: PPO on arithmetic
    python -m launch.train --config=configs/grpo_arith.py
    python -m launch.train --config.placement=split --config.actor.mesh=fsdp=2,tensor=2

Prints a progress bar, per-stage timings and tokens/s; the last stdout line is JSON with the
held-out accuracy before and after RL, the throughput and the wall time.
"""

import json
import os
import sys
import time

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(__file__), "..", "configs", "ppo_arith.py"),
    "configuration file (configs/*.py)",
)
_DEVICES = flags.DEFINE_integer(
    "cpu_devices",
    1,
    "simulated CPU devices when running on CPU, e.g. 8 to try placements and meshes on a laptop "
    "(0: leave XLA_FLAGS alone)",
)

_STAGES = ("gen", "old_log_prob", "ref", "values", "reward", "adv", "update_critic",
           "update_actor")


def _setup_devices():
    n = _DEVICES.value
    if n and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}"
        )


def main(argv):
    del argv
    _setup_devices()
    import jax
    from tqdm import tqdm

    if jax.default_backend() == "cpu":
        # Simulated CPU devices share two cores: programs with collectives that overlap in
        # flight can starve each other's participants, so CPU runs dispatch synchronously.
        jax.config.update("jax_cpu_enable_async_dispatch", False)

    from hfjax.trainer import Trainer

    cfg = _CONFIG.value
    logging.set_verbosity(logging.WARNING)
    t_start = time.perf_counter()
    trainer = Trainer(cfg)
    print(f"hfjax: {cfg.algorithm} on {jax.device_count()} {jax.devices()[0].platform} devices, "
          f"placement={cfg.placement}, actor mesh={cfg.actor.mesh}", flush=True)
    trainer.warm_start(on_log=lambda i, m: print(
        f"  warm start step {i}: loss {m['sft/loss']:.3f}", flush=True))
    acc_key = "val-core/hfjax/arith/acc/mean@1"
    before = trainer.validate()[acc_key]
    print(f"held-out accuracy before RL: {before:.3f}", flush=True)
    tokens, rl_time = 0.0, 0.0
    total = cfg.trainer.total_steps
    bar = tqdm(range(total), desc=cfg.algorithm, file=sys.stdout, dynamic_ncols=True)
    last = {}
    for step in bar:
        m = trainer.train_step()
        last = m
        if step > 0:  # the first step compiles; leave it out of the throughput
            tokens += m["perf/total_num_tokens"]
            rl_time += m["timing_s/step"]
        bar.set_postfix(reward=f"{m['critic/score/mean']:.2f}",
                        tok_s=f"{m['perf/throughput']:.0f}")
        if cfg.trainer.test_freq and (step + 1) % cfg.trainer.test_freq == 0 and step + 1 < total:
            acc = trainer.validate()[acc_key]
            bar.write(f"step {step + 1}: held-out accuracy {acc:.3f}")
    after = trainer.validate()[acc_key]
    stages = "  ".join(f"{s} {last[f'timing_s/{s}']:.3f}s" for s in _STAGES
                       if f"timing_s/{s}" in last)
    print(f"last step timings: {stages}")
    print(f"held-out accuracy after RL: {after:.3f} (before {before:.3f})")
    tok_s = tokens / rl_time if rl_time else 0.0
    print(json.dumps({
        "heldout_accuracy_before": round(before, 4),
        "heldout_accuracy_after": round(after, 4),
        "tokens_per_s": round(tok_s, 1),
        "wall_s": round(time.perf_counter() - t_start, 1),
    }))


if __name__ == "__main__":
    app.run(main)

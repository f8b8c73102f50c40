"""The padded log-prob pass (reference / old log-probs) of SmolLM2-135M on 128 sequences of
64 + 128 columns (bench/variable_length.py's chain_sum shape), f32, 1 CPU device: the whole batch
in one pass (micro_rows=all) against ppo_micro_batch_size rows at a time. Best of 2 runs.

    python -m bench.scoring_micro_batches
"""

import dataclasses
import time

import jax
import numpy as np

import hfjax.models as M
from configs import ppo_arith
from hfjax.controller.batch import Batch
from hfjax.engine.spec import RolloutSpec
from hfjax.models.smollm2 import smollm2_gguf_path
from hfjax.parallel.mesh import ResourcePool
from hfjax.workers.actor import Reference
from hfjax.workers.spec import ActorSpec

B, P, R = 128, 64, 128


def main() -> None:
    model = M.load(str(smollm2_gguf_path()), dtype="float32")
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 40000, (B, P + R)).astype(np.int32)
    mask = np.ones((B, P + R), np.int32)
    for i, n in enumerate(rng.integers(1, R + 1, B)):
        mask[i, P + n :] = 0
    batch = Batch({"input_ids": ids * mask, "attention_mask": mask,
                   "responses": (ids * mask)[:, P:]})
    pool = ResourcePool("bench", tuple(jax.devices()[:1]))
    # The default config's settings, one sample per prompt (no shared-prompt rows), padded
    # rows of `micro` at a time (0: the whole batch in one pass).
    cfg = ppo_arith.get_config()
    rollout, actor = RolloutSpec.of(cfg.rollout), ActorSpec.of(cfg.actor)
    for micro in (0, 64, 16, 8):
        spec = dataclasses.replace(actor, ppo_micro_batch_size=micro,
                                   use_remove_padding=False, group_by_length=False)
        ref = Reference("ref", pool, "fsdp=1", model, spec=spec, rollout=rollout)
        jax.block_until_ready(ref.compute_ref_log_prob(batch).arrays)  # compile
        runs = []
        for _ in range(2):
            start = time.perf_counter()
            jax.block_until_ready(ref.compute_ref_log_prob(batch).arrays)
            runs.append(time.perf_counter() - start)
        print(f"micro_rows={micro or 'all'}: {min(runs):.2f} s "
              f"(runs {' '.join(f'{x:.2f}' for x in runs)})", flush=True)


if __name__ == "__main__":
    main()

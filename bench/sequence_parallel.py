"""Sequence parallelism's traffic and memory, read from the compiled programs: what each program
of a run whose rows are split over `sequence` moves between devices, against the scheme's ideal.

The run's programs are compiled as the dry run compiles them (abstract shapes, no weights; every
per-backend choice made for a GPU target: bf16 attention inputs) on `--num_devices` simulated
CPU devices, once per scheme of `--schemes`. For every program of a group whose mesh splits
rows, from its optimized HLO:

- `a2a/layer`: bytes of the all-to-alls (Ulysses' exchanges) per layer and device, counted
  statically (a layer's scan body appears once per pass: forward, backward, and a forward
  recomputed for the backward where the remat policy recomputes it); `ideal`: four
  all-to-alls (q, k, v and the output) per layer and pass, forward only for scoring, forward
  and backward for an update: b x T / s x (2 N + 2 K') x head_dim x the compute dtype's bytes
  per pass, b a micro-batch's rows per data-parallel rank, K' the kv heads after repetition
  (`sequence_parallel.kv_repeats`);
- `ratio`: the exchange's bytes against the ideal, float32 exchanges counted at the compute
  dtype's bytes (XLA:CPU widens a bfloat16 all-to-all or collective-permute to float32, with a
  convert on each side; an accelerator moves bfloat16); `as cpu`: the same as compiled here;
- `permute/layer`: bytes of ring's collective-permutes, per layer: a step's K/V blocks (the scan
  body appears once) and, with the zig-zag placement, q, k, v moved to their places and the
  output moved back; its ideal (in `ideal` and `ratio` for ring): b x T / s x head_dim x the
  compute dtype's bytes x (2 K for the k and v blocks, + 2 N + 2 K for the placement) per pass,
  and for an update 2 K more: ring's backward passes the k and v blocks round the ring again,
  with their gradients (without keeping all s blocks of the forward, s times the memory);
- `row gathers`: all-gathers, all-reduces and reduce-scatters of activations (float arrays
  computed in the program, or its batch's) between devices at different `sequence`
  positions whose shape holds a row's full length (should be none:
  tests/models/test_sequence_parallel_hlo.py). What an operand holds is read from the HLO's
  dataflow (`hfjax.parallel.hlo.Module`), not from its shape: a weight gathered by FSDP
  whose dimensions happen to equal a row's length (a 70B's [8192, 512] kv projection at rows of
  512) or a gradient reduced over the data-parallel devices is none;
- `weight gathers`: those collectives' bytes of the model's weights (FSDP's gathers);
- `temp`: the program's temporary bytes per device (`memory_analysis().temp_size_in_bytes`);
  ring's update moves its K/V blocks three times per step (forward, the step recomputed in the
  backward pass, the blocks' gradients), which its ideal counts;
- for ring, the half-shard pairs each device computes per layer (the causally empty ones are
  skipped), zig-zag placement (`ring`) against the plain one (`ring-plain`: device d holds
  half-shards 2d, 2d + 1), and both placements' scoring programs' temporary memory; and, as
  `ring-dense`, ring's scoring programs with each half-shard's keys in one block (the dense
  float32 scores ring attention held before it folded keys RING_K_BLOCK at a time).

    python -m bench.sequence_parallel [--config=configs/grpo_long.py] [--num_devices=8] \\
        [--schemes=ulysses,ring]

HFJAX_SMOKE=1 (launch/smoke.py) runs the tiny preset on short rows. The last line is JSON.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

from absl import app, flags
from ml_collections import config_flags

from launch import smoke

_CONFIG = config_flags.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(__file__), "..", "configs", "grpo_long.py"),
    "the run config whose split programs are read (its actor.mesh / ref.mesh name sequence)")
flags.DEFINE_integer("num_devices", 8, "simulated devices the programs are compiled for")
flags.DEFINE_list("schemes", ["ulysses", "ring"], "sequence_parallel settings compared")
flags.DEFINE_list("programs", [], "only these programs (e.g. actor.log_prob); default: all")
flags.DEFINE_bool("dense_ring", True, "also compile ring's scoring programs with a shard's "
                  "keys in one block (ring-dense), for its temporary memory")
FLAGS = flags.FLAGS
# hfjax's programs take the model's parameters as their `params` argument, and jax names each
# entry parameter of the compiled program after the argument it comes from (`params['embed']`).
WEIGHTS_ARG = "params"


def traffic(text: str, row_lengths: set[int], mesh_shape: tuple[int, ...], seq_axis: int,
            weights: str = WEIGHTS_ARG) -> dict[str, float]:
    """Static bytes per device of the HLO's collectives, by kind. An all-gather, all-reduce or
    reduce-scatter is classified by what each of its operands holds (`hlo.operand_roles`), not
    by its shape: the model's weights (an entry parameter under the `weights` argument, sliced
    and cast but never computed on), gradients (values that leave the program on their way
    into the updated state), or activations. Only activations moved between devices at different
    `sequence` positions (axis `seq_axis` of `mesh_shape`) with a row's full length in their
    shape count as row gathers; weights' collectives are `weight_gathers`."""
    out = {"a2a": 0, "permute": 0, "row_gathers": 0, "weight_gathers": 0, "other": 0,
           "a2a_f32": 0, "permute_f32": 0}
    from hfjax.parallel import hlo

    roles = {(c.name, c.computation, i): role for c, i, role in hlo.operand_roles(text, weights)}
    for c in hlo.collectives(text):
        if c.group == 1:
            continue
        shapes, op, nbytes = c.shapes, c.op, c.nbytes
        f32 = sum(4 * math.prod(d) for dt, d in shapes if dt == "f32")
        if op == "all-to-all":
            out["a2a"] += nbytes
            out["a2a_f32"] += f32
            continue
        if op == "collective-permute":
            rank4 = any(len(d) == 4 and dt[0] in "fb" for dt, d in shapes)
            out["permute" if rank4 else "other"] += nbytes
            out["permute_f32"] += f32 if rank4 else 0
            continue
        over_rows = hlo.spans(c.line, mesh_shape, seq_axis)
        for i, (dt, dims) in enumerate(shapes):
            size = hlo.BYTES[dt] * math.prod(dims)
            role = roles.get((c.name, c.computation, i), "activations")
            if role == "weights":
                out["weight_gathers"] += size
            elif (role == "activations" and dt[0] in "fb" and over_rows
                  and set(dims) & row_lengths):
                out["row_gathers"] += size
            else:
                out["other"] += size
    return out


def _config(scheme: str):
    c = _CONFIG.value.copy_and_resolve_references()
    if smoke.enabled():  # the tiny preset on rows of 16 + 40 tokens, 4 sequences a step
        c.model.path = "preset:tiny"
        c.data.max_prompt_length, c.rollout.response_length = 16, 40
        c.data.train_batch_size, c.rollout.n, c.data.n_test = 2, 2, 2
        c.actor.ppo_mini_batch_size, c.actor.ppo_micro_batch_size = 2, 2
        c.rollout.mesh = "data=8"
    for role in ("actor", "ref", "critic"):
        if role in c:
            c[role].sequence_parallel = scheme
    return c


def main(argv):
    del argv
    from hfjax.parallel import distributed

    distributed.initialize(distributed.Settings("single process",
                                                cpu_devices=FLAGS.num_devices))
    from hfjax.models import backend
    from hfjax.models import sequence_parallel as sp
    from hfjax.run import dry_run

    rows, results = [], {}
    default_block = sp.RING_K_BLOCK
    print(f"{'scheme':10} {'program':18} {'a2a/layer':>11} {'ideal':>11} {'ratio':>6} "
          f"{'as cpu':>6} {'permute/layer':>14} {'row gathers':>11} {'weight gathers':>14} "
          f"{'temp':>9} {'compile s':>9}")
    schemes = list(FLAGS.schemes)
    if "ring" in schemes:
        schemes.append("ring-plain")
    if "ring" in schemes and FLAGS.dense_ring:
        schemes.append("ring-dense")
    for scheme in schemes:
        # ring-dense: ring attention with a shard's keys in one block, [T / s, T / s] scores
        # (what ring attention held before its key blocks), its scoring programs only.
        sp.RING_K_BLOCK = 1 << 30 if scheme == "ring-dense" else default_block
        sp.RING_BALANCED = scheme != "ring-plain"
        cfg = _config(scheme.split("-")[0])
        with backend.compiling_for("gpu"):
            w = dry_run.abstract_groups(cfg, platform="gpu")
            shape = dry_run.step_shape(w, cfg)
            for _, group in dry_run.device_groups(w):
                s = sp.sequence_size(group.layout)
                if s <= 1:
                    continue
                mcfg = group.config
                t = sp._tensor_split(mcfg.num_heads, mcfg.num_kv_heads, group.mesh.shape)
                n, k = mcfg.num_heads // t, mcfg.num_kv_heads // t
                k_rep = k * sp.kv_repeats(k, s)
                L, H = mcfg.num_layers, mcfg.head_dim
                width = sp.padded_width(shape.width, group.layout)
                lengths = {shape.width, width, shape.response_len}
                for p in group.programs(shape):
                    if FLAGS.programs and p.name not in FLAGS.programs:
                        continue
                    if scheme in ("ring-dense", "ring-plain") and p.trains:
                        continue
                    t0 = time.perf_counter()
                    compiled = p.fn.lower(*p.args).compile()
                    seconds = time.perf_counter() - t0
                    text = compiled.as_text()
                    temp = compiled.memory_analysis().temp_size_in_bytes
                    got = traffic(text, lengths, tuple(group.mesh.devices.shape),
                                  group.mesh.axis_names.index("sequence"))
                    b = _micro_rows(cfg, p, group)
                    passes = 2 if p.trains else 1
                    nb = mcfg.jnp_dtype.itemsize  # the exchange in the compute dtype
                    per_pass = b * (width // s) * (2 * n + 2 * k_rep) * H * nb
                    # XLA:CPU widens 16-bit collectives to float32 (a convert on each side):
                    # `at dtype` counts those float32 exchanges at the compute dtype's bytes,
                    # as an accelerator moves them.
                    shrink = 1 - nb / 4
                    a2a = got["a2a"] - got["a2a_f32"] * shrink
                    permute = got["permute"] - got["permute_f32"] * shrink
                    if scheme == "ulysses":
                        ideal = per_pass * passes
                        ratio = a2a / ideal
                    else:  # a step's k and v blocks, [b, T / s, K, head_dim], and their grads
                        kv = 2 * k * (3 if p.trains else 1)  # forward; backward: again + grads
                        placed = (2 * n + 2 * k) * sp.RING_BALANCED * passes
                        ideal = b * (width // s) * (kv + placed) * H * nb
                        ratio = permute / ideal
                    cpu = (got["a2a"] if scheme == "ulysses" else got["permute"]) / ideal
                    print(f"{scheme:10} {p.name:18} {_mib(a2a):>11} {_mib(ideal):>11} "
                          f"{ratio:6.2f} {cpu:6.2f} {_mib(permute):>14} "
                          f"{_mib(got['row_gathers']):>11} {_mib(got['weight_gathers']):>14} "
                          f"{_mib(temp):>9} "
                          f"{seconds:9.1f}", flush=True)
                    rows.append(dict(scheme=scheme, program=p.name, layers=L, rows=b,
                                     a2a_bytes=a2a, ideal_bytes=ideal, ratio=ratio,
                                     ratio_as_compiled_on_cpu=cpu,
                                     permute_bytes=permute, row_gather_bytes=got["row_gathers"],
                                     weight_gather_bytes=got["weight_gathers"],
                                     temp_bytes=int(temp), compile_s=round(seconds, 1)))
                if scheme == "ring" and "ring_block_pairs" not in results:
                    bal, plain = sp.ring_pairs(s, True), sp.ring_pairs(s, False)
                    results["ring_block_pairs"] = dict(devices=s, all_pairs=4 * s * s,
                                                       zigzag=bal, plain=plain)
                    print(f"ring: half-shard pairs computed per layer by each of {s} devices "
                          f"(of {4 * s * s} in all, the causally empty ones skipped): zig-zag "
                          f"{bal}, plain {plain}; the busiest device {max(bal)} against "
                          f"{max(plain)} ({max(plain) / max(bal):.2f}x)", flush=True)
    sp.RING_K_BLOCK, sp.RING_BALANCED = default_block, True
    results["programs"] = rows
    print(json.dumps(results))


def _micro_rows(cfg, p, group) -> int:
    """Rows per data-parallel device of one micro-batch of a program: the role's
    ppo_micro_batch_size sequences over its data-parallel ranks (the programs scan over
    micro-batches; an exchange in the scan body moves one micro-batch's rows)."""
    role = p.name.split(".")[0]
    micro = cfg[role].ppo_micro_batch_size if role in cfg and "ppo_micro_batch_size" in \
        cfg[role] else cfg.actor.ppo_micro_batch_size
    return max(1, micro // group.dp_size)


def _mib(n: float) -> str:
    for unit, size in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{int(n)}"


if __name__ == "__main__":
    sys.exit(app.run(main))

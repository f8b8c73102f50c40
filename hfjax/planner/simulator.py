"""The planner's simulator: seconds per stage for one model in one layout on a cluster.

A stage's time is built from a cost source's figures (`hfjax.planner.pricing`) and the
cluster's published rates:

- **compute-bound calls** (training, scoring passes, prefill): FLOPs / (peak x efficiency), or
  HBM bytes / (bandwidth x efficiency) if that is longer (a roofline per call);
- **generation**: a prefill, then `response_len` decode steps, each the longer of its weight and
  KV-cache reads over HBM bandwidth and its FLOPs over peak;
- **collectives**: a ring all-gather or reduce-scatter of X bytes over g devices moves
  (g-1)/g X per device, an all-reduce twice that; time = latency + bytes / (link bandwidth per
  direction x efficiency). A group of devices that fits in one node uses the node's link
  (NVLink, ICI), a larger one the scale-out network. What overlaps compute follows the
  programs' structure: FSDP all-gathers and reduce-scatters happen per layer inside the layer
  scan, next to other layers' matmuls, so XLA can run them asynchronously (a fraction
  `fsdp_overlap` of the call's compute hides them); tensor-parallel all-reduces sit between a
  layer's matmuls and the next, on the critical path; the data-parallel all-reduce of a
  micro-batch's gradients comes after its backward pass, before the accumulation that the
  next micro-batch's scan iteration waits on, so it is exposed too;
- **the hybrid transition**: the bytes a device receives (counted by
  `reshard.tree_transfer_bytes` over the engine's decode order, `virtual.transition_bytes`) over
  the micro-DP group's link; the way back is a local slice and costs nothing.

Per stage (hfjax's programs):
- training (`update_actor`, `update_critic`): epochs x (batch / mini-batch) calls; each call runs
  its micro-batches with, per micro-batch and layer, 4 tensor-parallel all-reduces of the
  micro-batch's hidden states (6 with remat "full"), FSDP all-gathers of the weights twice and a
  reduce-scatter of the gradients, an all-reduce of the gradients over `data`; then one Adam
  step (memory-bound: it reads parameters, gradients and both moments and writes three of them);
- scoring (`old_log_prob`, `ref`, `values`, `reward`): one forward call over the whole batch,
  2 tensor-parallel all-reduces per layer, one FSDP all-gather of the weights;
- generation (`gen`): on the decode mesh data=n/t_g, tensor=t_g, 2 tensor-parallel all-reduces
  per layer per step plus an all-gather of the step's logits.

## Efficiency factors

`Efficiency` holds the fractions of the peaks that programs reach. The defaults are assumptions
taken from public reports, not measured here: dense-transformer training on A100/H100 with
Megatron-style parallelism reports 40-55% of bf16 peak (model FLOPs utilisation), and we take
0.45 for every compute-bound call; memory-bound decoding kernels reach 60-80% of HBM bandwidth
(0.7); NCCL's measured bus bandwidth on NVLink is about 70-80% of the link's (0.7); collective
latency 10 us inside a node, 30 us across nodes. `bench/plan_calibration.py` fits the compute
and bandwidth factors to measured stage times of three small jobs on this machine's CPU (and
says how far the fitted model is from the measurements), once with the closed forms' prices
and once with compiled ones (`measured_cpu_efficiency`); `launch.plan --efficiency=...` takes
any of them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from hfjax.engine import shared_prompt
from hfjax.models.backend import storage_dtype
from hfjax.parallel.targets import Target, get_target
from hfjax.planner import virtual
from hfjax.planner.pricing import (
    Call,
    ClosedFormPrices,
    MeshLayout,
    ModelSpec,
    PriceSource,
    model_leaves,
)

GB = 10**9

# Devices per node and the scale-out bandwidth per device (bytes/s, one direction), from the
# vendors' reference systems: DGX A100 has one 200 Gb/s HDR InfiniBand adapter per GPU, DGX H100
# and DGX H200 one 400 Gb/s NDR adapter per GPU (8 GPUs on NVLink per node). A TPU slice is one
# ICI domain (v5e and v6e: up to 256 chips; v5p: a pod of 8,960); between slices the data-center
# network is slower, taken here as 100 Gb/s per chip (an assumption, not a published figure).
NODES: dict[str, tuple[int, float, str]] = {
    "h100": (8, 50 * GB, "DGX H100: 8 GPUs on NVLink, 400 Gb/s InfiniBand per GPU"),
    "h200": (8, 50 * GB, "DGX H200: 8 GPUs on NVLink, 400 Gb/s InfiniBand per GPU"),
    "a100-40gb": (8, 25 * GB, "DGX A100: 8 GPUs on NVLink, 200 Gb/s InfiniBand per GPU"),
    "a100-80gb": (8, 25 * GB, "DGX A100: 8 GPUs on NVLink, 200 Gb/s InfiniBand per GPU"),
    "v5e": (256, 12.5 * GB, "one v5e slice (256 chips) on ICI"),
    "v5p": (8960, 12.5 * GB, "one v5p pod (8,960 chips) on ICI"),
    "v6e": (256, 12.5 * GB, "one v6e slice (256 chips) on ICI"),
}


# This development machine's 8 simulated CPU devices (AMD EPYC, 2 cores shared with other
# jobs), measured by `python bench/plan_calibration.py` (docs/scaling.md, "Calibration"):
# per-device figures at the default job's sizes (best samples), and the factors fitted to the
# three calibration runs' stage times, once per price source: `efficiency` with the closed
# forms' prices, `efficiency_compiled` with compiled prices (`hfjax.planner.compiled`).
CPU_MEASURED = {
    "date": "2026-12-04",
    "float32_flops": 19.2e9,
    "bfloat16_flops": 30.3e9,
    "memory_bandwidth": 2.59e9,
    "gather_bandwidth": 1.77e9,
    "efficiency": {"train": 0.379, "forward": 0.610, "prefill": 0.366, "hbm": 0.366,
                   "link": 1.0, "call_overhead_s": 10.4e-3, "step_overhead_s": 2.11e-3},
    "efficiency_compiled": {"train": 0.381, "forward": 0.612, "prefill": 0.934, "hbm": 0.934,
                            "link": 1.0, "call_overhead_s": 10.0e-3, "step_overhead_s": 0.0},
}


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """Fractions of the published peaks that programs reach (module docstring)."""

    train: float = 0.45  # FLOP/s of a training call / peak
    forward: float = 0.45  # scoring passes (and decode-step FLOPs while `decode` is None)
    prefill: float = 0.45
    hbm: float = 0.7  # HBM bytes/s of memory-bound calls / peak
    link: float = 0.7  # collective bytes/s / link bandwidth
    fsdp_overlap: float = 1.0  # share of a call's compute that hides FSDP traffic
    latency_intra_s: float = 10e-6
    latency_inter_s: float = 30e-6
    call_overhead_s: float = 0.0  # fixed cost of a program call (dispatch, launch, sync)
    step_overhead_s: float = 0.0  # fixed cost of one decode step inside the decode loop
    decode: float | None = None  # decode-step FLOP/s / peak, where measured (None: `forward`)

    @classmethod
    def parse(cls, text: str, base: Efficiency | None = None) -> Efficiency:
        """Efficiency from 'train=0.4,hbm=0.6' (unnamed fields keep `base`'s values)."""
        base = base or cls()
        if not text.strip():
            return base
        known = {f.name for f in dataclasses.fields(cls)}
        values = {}
        for item in text.split(","):
            key, sep, value = item.partition("=")
            key = key.strip()
            if not sep or key not in known:
                raise ValueError(f"efficiency item {item.strip()!r}: write name=value with name "
                                 f"one of {', '.join(sorted(known))}")
            try:
                values[key] = float(value)
            except ValueError:
                raise ValueError(f"efficiency {key}={value!r} is not a number") from None
            if key.endswith("_s"):
                if values[key] < 0:
                    raise ValueError(f"efficiency {key}={value}: seconds cannot be negative")
            elif key == "fsdp_overlap":  # 0: no FSDP traffic hides behind compute
                if not 0 <= values[key] <= 1:
                    raise ValueError(f"efficiency {key}={value}: a fraction in [0, 1] is "
                                     "expected")
            elif not 0 < values[key] <= 1:
                raise ValueError(f"efficiency {key}={value}: a fraction in (0, 1] is expected")
        return dataclasses.replace(base, **values)


CALIBRATION_KEYS = ("decode_ms_per_step", "decode_bound_ms", "update_mfu", "ref_mfu")


def efficiency_from_calibration(data: dict, target: Target,
                                base: Efficiency | None = None) -> Efficiency:
    """The efficiency factors `bench/accelerator.py`'s JSON line measured, as fractions of
    `target`'s peak bf16 FLOP/s; other factors keep `base`'s values.

    - `decode`: decode_bound_ms / decode_ms_per_step (the share of the measured matmul peak a
      decode step reaches) times matmul_peak_flops / the target's peak;
    - `train`: update_mfu, times 4/3 when the measured run recomputed activations
      (`remat_policy=full`: the simulator counts the recomputed forward pass, MFU does not);
    - `forward`: ref_mfu.
    MFU figures are relative to the peak the JSON names (`mfu_peak`: the device kind's table
    figure, or the measured matmul peak). Raises ValueError naming a missing or bad key.
    """
    missing = [k for k in CALIBRATION_KEYS if not isinstance(data.get(k), (int, float))
               or not data[k] > 0]
    if missing:
        raise ValueError(f"calibration: {', '.join(missing)} missing or not a positive number; "
                         "give the last line that python -m bench.accelerator prints")
    peak = target.bf16_flops
    measured = float(data.get("matmul_peak_flops") or peak)
    mfu_peak = measured if data.get("mfu_peak") == "measured_matmul" else peak
    remat = (data.get("config") or {}).get("remat_policy")
    factors = {
        "decode": data["decode_bound_ms"] / data["decode_ms_per_step"] * measured / peak,
        "train": data["update_mfu"] * mfu_peak / peak * (4 / 3 if remat == "full" else 1),
        "forward": data["ref_mfu"] * mfu_peak / peak,
    }
    factors = {k: min(1.0, v) for k, v in factors.items()}
    return dataclasses.replace(base or Efficiency(), **factors)


@dataclasses.dataclass(frozen=True)
class Cluster:
    """A target device, how many of them share the fast link, and the network between nodes."""

    target: Target
    node_size: int
    scale_out_bandwidth: float  # bytes/s per device, one direction
    node_description: str = ""
    f32_flops: float | None = None  # float32 matmul FLOP/s where known (else half of bf16)
    efficiency: Efficiency | None = None  # calibrated factors (None: the public defaults)

    @property
    def link_bandwidth(self) -> float:
        """The fast link's bytes/s per device in one direction (the table gives both)."""
        return self.target.interconnect_bandwidth / 2


def measured_cpu_efficiency(prices: str = "closed_form") -> Efficiency:
    """The factors bench/plan_calibration.py fitted on this machine's CPU devices for a price
    source ("closed_form" or "compiled": each source's FLOPs and bytes need their own)."""
    key = {"closed_form": "efficiency", "compiled": "efficiency_compiled"}.get(prices)
    if key is None:
        raise ValueError(f"prices={prices!r}: one of closed_form, compiled")
    return Efficiency(**CPU_MEASURED[key])


def measured_cpu() -> Cluster:
    """This development machine's 8 simulated CPU devices (one node), from
    bench/plan_calibration.py: measured per-device matmul FLOP/s, memory and all-gather
    bandwidth, and the efficiency factors fitted to the calibration runs' stage times there
    with the closed forms' prices. Memory is the host's 23 GB shared by the 8 devices."""
    m = CPU_MEASURED
    target = Target("cpu", "8 simulated CPU devices of the development machine (measured)",
                    int(23e9 / 8), m["bfloat16_flops"], m["memory_bandwidth"],
                    2 * m["gather_bandwidth"], "shared memory",
                    "bench/plan_calibration.py, " + m["date"], platform="cpu")
    return Cluster(target, 8, m["gather_bandwidth"], "one host", f32_flops=m["float32_flops"],
                   efficiency=measured_cpu_efficiency("closed_form"))


def cluster_for(target: str | Target, node_size: int | None = None,
                scale_out_bandwidth: float | None = None) -> Cluster:
    """The Cluster of a target name (ValueError for unknown names), with the reference
    system's node size and scale-out network unless given. "cpu" is this machine's simulated
    devices as measured (`measured_cpu`)."""
    if isinstance(target, str) and target.strip().lower() == "cpu":
        cpu = measured_cpu()
        return dataclasses.replace(cpu, node_size=node_size or cpu.node_size)
    t = get_target(target) if isinstance(target, str) else target
    node, scale_out, what = NODES.get(t.name, (8, 25 * GB, "assumed: 8 devices per node"))
    if node_size is not None:
        if node_size <= 0:
            raise ValueError(f"node_size={node_size}: give the devices per node, at least 1")
        node = node_size
    if scale_out_bandwidth is not None:
        scale_out = scale_out_bandwidth
    return Cluster(t, node, scale_out, what)


@dataclasses.dataclass(frozen=True)
class Workload:
    """One RL step's batch shape and update schedule (hfjax's buckets applied).

    prompts: prompts per step; n: samples per prompt; prompt_len / response_len: the prompt and
    new-token buckets the sampler pads to; *_mini / *_micro: rows (sequences) per mini- and
    micro-batch; old_log_prob: whether the step scores its samples under the pre-update policy.

    How the programs batch their work (hfjax's sampler and scoring passes today take the whole
    batch in one call, the defaults; a paged, continuously batching engine and micro-batched
    scoring are what the paper's systems run):
    score_micro: rows per scoring call (0: the whole batch in one call);
    gen_rows: rows a decode replica generates at once (0: all of its rows; -1: the planner
    picks, per layout, among halvings of all its rows, trading memory for weight reads).
    shared: responses per row in the actor's and the reference's passes (`actor.share_prompt`,
    `hfjax.engine.shared_prompt.samples_per_row`; 1: padded rows). As in the runs, a pass whose
    micro-batch groups don't split over a layout's data-parallel devices uses padded rows.
    """

    prompts: int
    n: int
    prompt_len: int
    response_len: int
    actor_mini: int
    actor_micro: int
    actor_epochs: int = 1
    critic_mini: int = 0
    critic_micro: int = 0
    critic_epochs: int = 1
    old_log_prob: bool = True
    score_micro: int = 0
    gen_rows: int = 0
    shared: int = 1

    @property
    def sequences(self) -> int:
        return self.prompts * self.n

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.response_len

    @property
    def tokens(self) -> int:
        """Prompt and response tokens of the step (the paper's throughput numerator)."""
        return self.sequences * self.seq_len

    def micro(self, role: str) -> int:
        return self.critic_micro if role == "critic" else self.actor_micro

    def call(self, kind: str, role: str, rows: int, micro: int, dp: int) -> Call:
        """A scoring ("forward") or training call of `role` over `rows` sequences in
        micro-batches of `micro`, as shared-prompt rows where the role's passes use them
        (`shared`) and a micro-batch's groups split over `dp` devices, else padded rows."""
        k = self.shared if role in ("actor", "ref", "teacher") else 1
        if k > 1 and shared_prompt.fits(micro, k, dp):
            return Call(kind, rows // k, self.prompt_len + k * self.response_len,
                        k * self.response_len, micro // k if kind == "train" else 0, k)
        return Call(kind, rows, self.seq_len, self.response_len,
                    micro if kind == "train" else 0)

    def check(self) -> None:
        """Raises ValueError unless the batch splits into mini- and micro-batches."""
        s = self.sequences
        for who, mini, micro in (("actor", self.actor_mini, self.actor_micro),
                                 ("critic", self.critic_mini, self.critic_micro)):
            if who == "critic" and not mini:
                continue
            if mini <= 0 or s % mini or micro <= 0 or mini % micro:
                raise ValueError(f"{who}: {s} sequences do not split into mini-batches of {mini}"
                                 f" and micro-batches of {micro}; pick divisors")


@dataclasses.dataclass(frozen=True)
class StageTime:
    """A stage's seconds and where they go (compute/memory roofline, tensor-parallel and
    exposed data-parallel collectives, the hybrid transition, prefill)."""

    seconds: float
    parts: Mapping[str, float]


def stages_of(role: str, workload: Workload) -> tuple[str, ...]:
    """The stages a role runs in one step of the RLHF dataflow."""
    if role == "actor":
        return ("gen", "old_log_prob", "update_actor") if workload.old_log_prob else (
            "gen", "update_actor")
    return {"ref": ("ref",), "critic": ("values", "update_critic"),
            "reward": ("reward",)}.get(role, (role,))


class Simulator:
    """Prices a model's stages in a layout on `cluster` from `costs` (closed forms by default)."""

    def __init__(self, cluster: Cluster, workload: Workload,
                 efficiency: Efficiency | None = None, costs: PriceSource | None = None):
        self.cluster = cluster
        self.workload = workload
        self.eff = efficiency or cluster.efficiency or Efficiency()
        self.costs = costs or ClosedFormPrices(cluster.target.platform)

    # -- rates -----------------------------------------------------------------------------------

    def peak_flops(self, model: ModelSpec) -> float:
        """Peak FLOP/s for the model's compute dtype: the table's bf16 rate; half of it for
        float32 (TF32 tensor cores run at half the bf16 rate; TPUs emulate float32 matmuls in
        several bf16 passes)."""
        bf16 = self.cluster.target.bf16_flops
        if model.config.dtype in ("bfloat16", "float16"):
            return bf16
        return self.cluster.f32_flops or bf16 / 2

    def _link(self, span: int) -> tuple[float, float]:
        c = self.cluster
        if span <= c.node_size:
            return c.link_bandwidth * self.eff.link, self.eff.latency_intra_s
        return c.scale_out_bandwidth * self.eff.link, self.eff.latency_inter_s

    def gather(self, nbytes: float, group: int, span: int, count: int = 1) -> float:
        """Seconds of `count` ring all-gathers (or reduce-scatters) of `nbytes` each (the full
        array) over `group` devices spanning `span` consecutive devices."""
        if group <= 1 or count <= 0:
            return 0.0
        bw, lat = self._link(span)
        return count * (lat + (group - 1) / group * nbytes / bw)

    def all_reduce(self, nbytes: float, group: int, span: int, count: int = 1) -> float:
        """Seconds of `count` ring all-reduces of `nbytes` each."""
        return 2 * self.gather(nbytes, group, span, count)

    def roofline(self, model: ModelSpec, flops: float, nbytes: float,
                 efficiency: float) -> tuple[float, float]:
        """(compute seconds, memory seconds) of one call."""
        t = self.cluster.target
        return (flops / (self.peak_flops(model) * efficiency),
                nbytes / (t.memory_bandwidth * self.eff.hbm))

    # -- stages ------------------------------------------------------------------------------

    def score_call(self, model: ModelSpec, lay: MeshLayout) -> tuple[int, Call]:
        """(calls, the shape of one) of `model`'s scoring pass over the step's sequences."""
        w = self.workload
        rows = w.score_micro if 0 < w.score_micro < w.sequences else w.sequences
        return math.ceil(w.sequences / rows), w.call("forward", model.role, rows, rows, lay.dp)

    def train_call(self, model: ModelSpec, lay: MeshLayout) -> tuple[int, Call]:
        """(calls, the shape of one) of `model`'s update: one call per mini-batch and epoch."""
        w = self.workload
        critic = model.role == "critic"
        mini = w.critic_mini if critic else w.actor_mini
        epochs = w.critic_epochs if critic else w.actor_epochs
        return epochs * (w.sequences // mini), w.call("train", model.role, mini,
                                                      w.micro(model.role), lay.dp)

    def forward(self, model: ModelSpec, lay: MeshLayout) -> StageTime:
        """A scoring pass over the step's sequences (old log-probs, reference, values, reward)."""
        cfg = model.config
        calls, call = self.score_call(model, lay)
        cost = self.costs.call(model, lay, call)
        compute, memory = self.roofline(model, cost.flops, cost.bytes_accessed, self.eff.forward)
        kernel = max(compute, memory)
        rows = math.ceil(call.rows / lay.dp)
        hidden = rows * call.seq * cfg.hidden_size * _itemsize(cfg.dtype) / lay.sequence
        tp = self.all_reduce(hidden, lay.tensor, lay.tensor, 2 * cfg.num_layers)
        tp += self.ulysses(model, lay, rows * call.seq, 1)
        weights = _model_bytes(model) / lay.tensor
        shards = lay.fsdp * lay.sequence
        fsdp = self.gather(weights, shards, shards * lay.tensor)
        dp = max(0.0, fsdp - self.eff.fsdp_overlap * kernel)
        over = self.eff.call_overhead_s
        return StageTime(calls * (kernel + tp + dp + over), {
            "compute": calls * compute, "memory": calls * memory, "tp": calls * tp,
            "dp": calls * dp, "overhead": calls * over})

    def train(self, model: ModelSpec, lay: MeshLayout) -> StageTime:
        """The PPO update of a trained model: epochs x mini-batches of micro-batched steps."""
        cfg = model.config
        calls, call = self.train_call(model, lay)
        n_micro = call.rows // call.micro
        cost = self.costs.call(model, lay, call)
        compute, memory = self.roofline(model, cost.flops, cost.bytes_accessed, self.eff.train)
        kernel = max(compute, memory)
        m = math.ceil(call.micro / lay.dp)
        hidden = m * call.seq * cfg.hidden_size * _itemsize(cfg.dtype) / lay.sequence
        per_layer = 6 if cfg.remat_policy == "full" else 4
        tp = self.all_reduce(hidden, lay.tensor, lay.tensor, per_layer * cfg.num_layers * n_micro)
        # forward, backward (twice the exchanges) and remat's second forward
        tp += self.ulysses(model, lay, m * call.seq, n_micro * (3 + (cfg.remat_policy == "full")))
        weights = _model_bytes(model) / lay.tensor
        shards = lay.fsdp * lay.sequence
        fsdp = self.gather(weights, shards, shards * lay.tensor, 3 * n_micro)
        data = self.all_reduce(weights / shards, lay.data, lay.n, n_micro)
        dp = max(0.0, fsdp - self.eff.fsdp_overlap * kernel) + data
        state = self.costs.state(model, lay)
        adam = (2 * state.params + 2 * state.optimizer + 3 * state.params) / (
            self.cluster.target.memory_bandwidth * self.eff.hbm)
        over = self.eff.call_overhead_s
        per_call = kernel + tp + dp + adam + over
        return StageTime(calls * per_call, {"compute": calls * compute, "memory": calls * memory,
                                            "tp": calls * tp, "dp": calls * dp,
                                            "optimizer": calls * adam, "overhead": calls * over})

    def ulysses(self, model: ModelSpec, lay: MeshLayout, tokens: int, passes: int) -> float:
        """Seconds of sequence parallelism's all-to-alls over `passes` passes of the layers on
        `tokens` tokens per data-parallel rank: per layer, q/k/v there and the output back,
        each device exchanging (sp - 1) / sp of its share (priced as a gather of that much)."""
        sp = lay.sequence
        if sp <= 1 or passes <= 0:
            return 0.0
        cfg = model.config
        a = storage_dtype(cfg.jnp_dtype, self.cluster.target.platform).itemsize
        per_layer = tokens * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim * a / (
            lay.tensor)
        return self.gather(per_layer, sp, sp * lay.tensor, passes * cfg.num_layers)

    def gen_rows_options(self, n: int, tensor_g: int) -> list[int]:
        """Rows a decode replica may generate at once (module docstring of Workload)."""
        w = self.workload
        rows = math.ceil(w.sequences / (n // tensor_g))
        if w.gen_rows == 0:
            return [rows]
        if w.gen_rows > 0:
            return [min(w.gen_rows, rows)]
        out = []
        while rows >= max(1, w.n) and len(out) < 8:
            out.append(rows)
            rows = math.ceil(rows / 2)
        return out

    def gen_calls(self, n: int, tensor_g: int, rows: int) -> tuple[int, Call, Call]:
        """(rounds, prefill call, decode-step call) when each of the n/t_g decode replicas
        generates `rows` rows at a time."""
        w = self.workload
        replicas = n // tensor_g
        per_replica = math.ceil(w.sequences / replicas)
        rounds = math.ceil(per_replica / rows)
        prompts = replicas * math.ceil(rows / w.n)
        return (rounds, Call("prefill", prompts, w.prompt_len),
                Call("decode", replicas * rows, w.seq_len))

    def generate(self, model: ModelSpec, lay: MeshLayout, tensor_g: int, engine: bool,
                 rows: int | None = None) -> tuple[StageTime, float]:
        """Generation on the decode mesh data=n/t_g, tensor=t_g (the training mesh itself when
        `engine` is off), each replica generating `rows` rows at a time (None: all of them).
        Returns (the stage's time, bytes per device the decode layout holds beyond the
        training shard of the weights)."""
        w, cfg = self.workload, model.config
        dec = MeshLayout(data=lay.n // tensor_g, tensor=tensor_g, rules="decode")
        rows = rows or self.gen_rows_options(lay.n, tensor_g)[0]
        rounds, pre_call, step_call = self.gen_calls(lay.n, tensor_g, rows)
        # The decode tensor group and the micro-DP group both lie inside one fsdp x tensor block
        # (nested rules) or one tensor group (train rules): hfjax.engine.hybrid's device order.
        span = lay.fsdp * lay.sequence * lay.tensor if lay.rules == "nested_train" else lay.tensor
        transition = 0.0
        held_extra = 0.0
        if engine:
            received, held = virtual.transition_bytes(model_leaves(model), lay.rules,
                                                      lay.sizes(), tensor_g)
            bw, lat = self._link(lay.fsdp * lay.sequence * lay.tensor)
            transition = received / bw + lat * len(model_leaves(model))
            held_extra = max(0.0, held - self.costs.state(model, lay).params)
        pre = self.costs.call(model, dec, pre_call)
        pc, pm = self.roofline(model, pre.flops, pre.bytes_accessed, self.eff.prefill)
        rows_p = math.ceil(pre_call.rows / dec.dp)
        pre_tp = self.all_reduce(rows_p * w.prompt_len * cfg.hidden_size * _itemsize(cfg.dtype),
                                 tensor_g, span, 2 * cfg.num_layers)
        step = self.costs.call(model, dec, step_call)
        sc, sm = self.roofline(model, step.flops, step.bytes_accessed,
                               self.eff.decode or self.eff.forward)
        step_tp = self.all_reduce(rows * cfg.hidden_size * _itemsize(cfg.dtype), tensor_g, span,
                                  2 * cfg.num_layers)
        step_tp += self.gather(rows * cfg.vocab_size * 4, tensor_g, span)
        steps = rounds * w.response_len
        prefill = rounds * (max(pc, pm) + pre_tp)
        over = 2 * rounds * self.eff.call_overhead_s + steps * self.eff.step_overhead_s
        total = transition + prefill + steps * (max(sc, sm) + step_tp) + over
        parts = {"transition": transition, "prefill": prefill,
                 "decode_compute": steps * sc, "decode_memory": steps * sm,
                 "tp": steps * step_tp, "overhead": over}
        return StageTime(total, parts), held_extra

    def extra_bytes(self, model: ModelSpec, lay: MeshLayout, stage: str,
                    tensor_g: int | None = None, rows: int | None = None) -> float:
        """Bytes per device a stage holds on top of the model's state (generation: the decode
        layout's own buffers; the engine's larger weight shard is `generate`'s to report)."""
        if stage == "gen":
            dec = MeshLayout(data=lay.n // tensor_g, tensor=tensor_g, rules="decode")
            rows = rows or self.gen_rows_options(lay.n, tensor_g)[0]
            _, pre_call, step_call = self.gen_calls(lay.n, tensor_g, rows)
            pre = self.costs.call(model, dec, pre_call)
            step = self.costs.call(model, dec, step_call)
            return max(pre.extra_bytes, step.extra_bytes)
        if stage.startswith("update_"):
            return self.costs.call(model, lay, self.train_call(model, lay)[1]).extra_bytes
        return self.costs.call(model, lay, self.score_call(model, lay)[1]).extra_bytes


def async_step_seconds(gen_s: float, train_s: float, push_s: float,
                       max_staleness: int) -> float:
    """Seconds per step, in steady state, of a run whose rollout has a pool of its own
    (docs/async.md): `gen_s` generating one batch there, `train_s` the rest of the step on the
    trainer's pool, `push_s` moving the weights across after each update.

    K = 0 runs the three in turn. With K >= 1 the batch of step s is generated with the
    weights pushed after update s - K, so while the trainer runs step s - 1 (and pushes after
    it, in its own thread) the rollout generates step s: the slower side sets the pace. A
    larger K admits the same steady state; it only absorbs steps whose times vary."""
    if max_staleness <= 0:
        return gen_s + train_s + push_s
    return max(gen_s, train_s + push_s)


def push_seconds(cluster: Cluster, model: ModelSpec, across_nodes: bool) -> float:
    """Seconds to push `model`'s parameters from the trainer's pool to the rollout's: every
    byte crosses once, over the fast link, or the network between nodes."""
    bandwidth = cluster.scale_out_bandwidth if across_nodes else cluster.link_bandwidth
    return _model_bytes(model) / bandwidth


def _model_bytes(model: ModelSpec) -> float:
    return float(sum(leaf.nbytes for leaf in model_leaves(model)))


def _itemsize(dtype: str) -> int:
    import numpy as np

    return int(np.dtype(dtype).itemsize)

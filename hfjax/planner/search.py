"""Auto device mapping (HybridFlow §6, Algorithms 1 and 2): which models share devices, how many
devices each set gets, and every model's mesh, chosen by simulated iteration time.

`plan()` does what Algorithm 1 does:

1. **Placements**: every set partition of the models that live on devices (Bell(4) = 15 for
   actor, critic, reference and a reward model). The rollout stays with the actor (the hybrid
   engine generates with the actor's weights on its devices); roles without a device model,
   such as a rule reward scored on the host, join the actor's pool and cost nothing.
2. **Minimum allocation** per colocated set: the fewest devices on which some choice of layouts
   holds all of the set's models, their state (parameters, Adam moments) resident together and
   the largest stage's working memory (activations, gradients, KV cache) on top, within
   `memory_fraction` of each device's memory.
3. **Allocations**: every way of splitting the devices among the sets, each at least its
   minimum. Pool sizes are multiples of a granularity (1 up to 64 devices, then the smallest
   power of two that keeps 64 steps) so that 1,024 devices plan in seconds.
4. **Per model** (Algorithm 2): every mesh data x fsdp x tensor of the pool whose sizes the
   model's shapes and micro-batch allow (with rows of LONG_ROWS tokens or more, also
   data x fsdp x sequence x tensor: sequence parallelism, sequence sizes up to 8 that Ulysses
   can split the heads by), and for the actor every decode layout data_g x
   tensor_g that the 3D-HybridEngine can nest its training shards in (training rules "train",
   or "nested_train" when fsdp > 1); each priced by `hfjax.planner.simulator`. Within a
   colocated set, the layouts that minimise the set's busy time (the sum of its stages) while
   fitting in memory together.
5. **Cost**: the dataflow's stages scheduled in program order, each when its inputs are ready
   and its pool is free: stages of one colocated set add up, sets on disjoint devices run at
   once, and the iteration is the critical path (the paper's d_cost).

The planner takes the models and the dataflow from its caller (`launch/plan.py` reads them from
a run config and the algorithm registry); it imports no workers or algorithms. Its figures come
from a `PriceSource` (closed forms by default; a compiled source plugs in as `costs=`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterable, Mapping, Sequence

from hfjax.models import sequence_parallel as sp
from hfjax.planner import virtual
from hfjax.planner.pricing import (
    MeshLayout,
    ModelSpec,
    PriceSource,
    model_leaves,
    param_shard_bytes,
)
from hfjax.planner.simulator import (
    Cluster,
    Efficiency,
    Simulator,
    StageTime,
    Workload,
    cluster_for,
    stages_of,
)

DEVICE_ROLES = ("actor", "critic", "ref", "reward", "teacher")
# Rows (prompt + response tokens) from which layouts with sequence parallelism are considered:
# below it one row's activations are small beside a device's memory.
LONG_ROWS = 8192
MAX_STEPS = 64  # pool sizes per split: the granularity keeps N / granularity at or below this


class PlanError(ValueError):
    """The cluster cannot run the models: the message says what is missing and what to change."""


@dataclasses.dataclass(frozen=True)
class Stage:
    """One node of the dataflow: a role's stage and the stages whose outputs it reads."""

    name: str
    role: str
    deps: tuple[str, ...] = ()


def rlhf_dataflow(roles: Iterable[str], old_log_prob: bool = True) -> tuple[Stage, ...]:
    """The stages of one step of an RLHF algorithm with these roles, in program order: generate;
    score the samples (old log-probs, reference, teacher, values, reward); update critic and
    actor (after the advantage, which reads every score)."""
    roles = set(roles)
    stages = [Stage("gen", "actor")]
    scoring = [("old_log_prob", "actor")] if old_log_prob else []
    scoring += [(r, r) for r in ("ref", "teacher") if r in roles]
    scoring += [("values", "critic")] if "critic" in roles else []
    scoring += [("reward", "reward")] if "reward" in roles else []
    stages += [Stage(name, role, ("gen",)) for name, role in scoring]
    after = tuple(["gen"] + [name for name, _ in scoring])
    if "critic" in roles:
        stages.append(Stage("update_critic", "critic", after))
    stages.append(Stage("update_actor", "actor", after))
    return tuple(stages)


def set_partitions(items: Sequence[str]) -> list[tuple[tuple[str, ...], ...]]:
    """Every partition of `items` into non-empty sets (Bell(len(items)) of them); each set keeps
    the items' order, and sets are ordered by their first item."""
    items = list(items)
    if not items:
        return [()]
    first, rest = items[0], items[1:]
    out = []
    for part in set_partitions(rest):
        out.append(((first,),) + part)
        for i in range(len(part)):
            out.append(part[:i] + ((first,) + part[i],) + part[i + 1:])
    return [tuple(sorted(p, key=lambda block: items.index(block[0]))) for p in out]


def granularity(n_devices: int) -> int:
    """Pool sizes are multiples of this: 1 up to MAX_STEPS devices, else the smallest power of
    two g with n / g <= MAX_STEPS."""
    g = 1
    while n_devices / g > MAX_STEPS:
        g *= 2
    return g


@dataclasses.dataclass(frozen=True)
class Choice:
    """One model's layout on its pool, and what it costs there."""

    role: str
    layout: MeshLayout
    tensor_g: int | None  # the actor's decode tensor size
    engine: bool  # the actor decodes through the 3D-HybridEngine
    gen_rows: int | None  # rows each decode replica generates at once
    stages: Mapping[str, StageTime]
    state_bytes: float  # per device, resident
    extra_bytes: float  # per device, the largest stage's working memory on top

    @property
    def busy(self) -> float:
        return sum(s.seconds for s in self.stages.values())

    @property
    def decode_mesh(self) -> str:
        """The rollout mesh: empty when the actor decodes in its training layout."""
        if not self.engine or self.tensor_g is None:
            return ""
        d = self.layout.n // self.tensor_g
        parts = [f"data={d}"] if d > 1 else []
        parts += [f"tensor={self.tensor_g}"] if self.tensor_g > 1 else []
        return ",".join(parts) or "data=1"


@dataclasses.dataclass(frozen=True)
class SetChoice:
    """The layouts of a colocated set's models on a pool of `size` devices."""

    roles: tuple[str, ...]
    size: int
    choices: Mapping[str, Choice]
    peak_bytes: float

    @property
    def busy(self) -> float:
        return sum(c.busy for c in self.choices.values())


@dataclasses.dataclass(frozen=True)
class ScheduledStage:
    name: str
    role: str
    pool: str
    start: float
    end: float
    parts: Mapping[str, float]

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclasses.dataclass(frozen=True)
class Plan:
    """A placement, its allocation, every model's layout and the simulated schedule."""

    pools: Mapping[str, tuple[int, tuple[str, ...]]]  # name -> (size, roles incl. rollout)
    sets: Mapping[str, SetChoice]  # pool name -> its models' layouts
    schedule: tuple[ScheduledStage, ...]
    iteration_s: float
    tokens: int
    memory_bytes: int  # per device, of the target

    @property
    def choices(self) -> dict[str, Choice]:
        return {r: c for s in self.sets.values() for r, c in s.choices.items()}

    @property
    def placement_key(self) -> tuple[tuple[str, ...], ...]:
        return tuple(s.roles for s in self.sets.values())

    @property
    def mode(self) -> str:
        """colocate (one pool), standalone (one model per pool) or split (anything between)."""
        n_sets, n_models = len(self.sets), len(self.choices)
        if n_sets == 1:
            return "colocate"
        return "standalone" if n_sets == n_models else "split"

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.iteration_s

    def meshes(self) -> dict[str, str]:
        return {r: c.layout.mesh for r, c in self.choices.items()}

    def placement(self) -> dict[str, dict]:
        """{pool: {"size": n, "roles": [...]}}: the config's placement mapping."""
        return {name: {"size": size, "roles": list(roles)}
                for name, (size, roles) in self.pools.items()}

    def placement_string(self) -> str:
        """The placement in the command-line spelling 'pool=size:role+role;...'."""
        return ";".join(f"{name}={size}:{'+'.join(roles)}"
                        for name, (size, roles) in self.pools.items())

    def overrides(self) -> dict[str, object]:
        """Config keys and values that run this plan: the placement, every model's mesh, the
        actor's training rules and the rollout (decode) mesh."""
        out: dict[str, object] = {"placement": self.placement_string()}
        for role, choice in self.choices.items():
            out[f"{role}.mesh"] = choice.layout.mesh
        actor = self.choices["actor"]
        out["actor.rules"] = actor.layout.rules
        out["rollout.mesh"] = actor.decode_mesh
        out["rollout.hybrid_engine"] = True
        return out

    def summary(self) -> dict:
        """A JSON-able record of the plan."""
        actor = self.choices["actor"]
        return {
            "placement": self.placement(),
            "mode": self.mode,
            "meshes": self.meshes(),
            "rollout_mesh": actor.decode_mesh,
            "actor_rules": actor.layout.rules,
            "estimated_iteration_s": float(f"{self.iteration_s:.4g}"),
            "tokens_per_s": round(self.tokens_per_s, 1),
            "stages": {s.name: float(f"{s.seconds:.4g}") for s in self.schedule},
            "peak_memory_gb": {name: round(s.peak_bytes / 1e9, 2) for name, s in self.sets.items()},
        }


@dataclasses.dataclass
class PlanResult:
    """The best plan, the best plan of each other placement (fastest first), and search
    statistics."""

    best: Plan
    alternatives: list[Plan]
    placements: int
    allocations: int
    seconds: float
    cluster: Cluster
    workload: Workload
    # The fewest devices each colocated set fits on (pool name -> devices; None: not within
    # the cluster), for every set of every placement.
    min_allocation: dict[str, int | None] = dataclasses.field(default_factory=dict)


class _Search:
    """The cached per-model and per-set evaluations of one planning run."""

    def __init__(self, models: Mapping[str, ModelSpec], sim: Simulator, budget: float):
        self.models = models
        self.sim = sim
        self.budget = budget
        self._model_cache: dict[tuple[str, int], list[Choice]] = {}
        self._set_cache: dict[tuple[tuple[str, ...], int], SetChoice | None] = {}

    # -- one model -------------------------------------------------------------------------------

    def layouts(self, role: str, n: int) -> list[tuple[MeshLayout, int | None, bool]]:
        """Every (training layout, decode tensor size, engine on) for `role` on n devices that
        the model's shapes and micro-batch allow (memory not checked)."""
        model = self.models[role]
        cfg = model.config
        micro = self.sim.workload.micro(role)
        out = []
        for t in _divisors(n):
            if cfg.num_heads % t:
                continue
            for s, f in self._sequence_fsdp(cfg, n, t):
                d = n // (t * s * f)
                if model.trainable and micro % (d * f):
                    continue
                sharded = f * s > 1
                rule_sets = ["train"] + (["nested_train"] if role == "actor" and sharded else [])
                for rules in rule_sets:
                    lay = MeshLayout(d, f, t, rules, sequence=s)
                    try:
                        param_shard_bytes(model, lay)
                    except ValueError:
                        continue  # a dimension the mesh cannot split
                    if role != "actor":
                        out.append((lay, None, False))
                        continue
                    for t_g in _divisors(f * s * t):
                        if cfg.num_heads % t_g:
                            continue
                        if f * s == 1 and t_g == t:
                            # The decode layout is the training layout: no engine.
                            if rules == "train":
                                out.append((lay, t_g, False))
                            continue
                        try:
                            virtual.transition_bytes(model_leaves(model), rules,
                                                     lay.sizes(), t_g)
                        except virtual.NoNesting:
                            continue
                        out.append((lay, t_g, True))
        return out

    def _sequence_fsdp(self, cfg, n: int, t: int) -> list[tuple[int, int]]:
        """(sequence size, fsdp size) pairs on n / t devices: sequence 1 only, unless the rows
        are at least LONG_ROWS tokens; then also every sequence size that Ulysses can split the
        model's heads by (`hfjax.models.sequence_parallel.heads_problem`), up to 8."""
        rest = n // t
        sizes = [1]
        if self.sim.workload.seq_len >= LONG_ROWS:
            sizes += [s for s in _divisors(rest) if 1 < s <= 8 and sp.heads_problem(
                cfg.num_heads, cfg.num_kv_heads, {"sequence": s, "tensor": t}, "ulysses") is None]
        return [(s, f) for s in sizes for f in _divisors(rest // s)]

    def evaluate(self, role: str, lay: MeshLayout, t_g: int | None, engine: bool) -> list[Choice]:
        """The model's Choices in one training layout (one per generation batch size for the
        actor)."""
        model, sim = self.models[role], self.sim
        stages: dict[str, StageTime] = {}
        extra = 0.0
        for stage in stages_of(role, sim.workload):
            if stage != "gen":
                stages[stage] = sim.train(model, lay) if stage.startswith("update_") else (
                    sim.forward(model, lay))
                extra = max(extra, sim.extra_bytes(model, lay, stage))
        state = sim.costs.state(model, lay).total
        if role != "actor":
            return [Choice(role, lay, None, False, None, stages, state, extra)]
        out = []
        for rows in sim.gen_rows_options(lay.n, t_g):
            gen, held = sim.generate(model, lay, t_g, engine, rows)
            gen_extra = held + sim.extra_bytes(model, lay, "gen", t_g, rows)
            out.append(Choice(role, lay, t_g, engine, rows, {"gen": gen, **stages}, state,
                              max(extra, gen_extra)))
        return out

    def choices(self, role: str, n: int) -> list[Choice]:
        """The model's Pareto-best choices on n devices (no other choice is at least as fast and
        at least as small in both resident and working memory), fastest first."""
        key = (role, n)
        if key not in self._model_cache:
            every = [c for spec in self.layouts(role, n) for c in self.evaluate(role, *spec)]
            every = [c for c in every if c.state_bytes + c.extra_bytes <= self.budget]
            every.sort(key=lambda c: (c.busy, c.state_bytes + c.extra_bytes))
            front: list[Choice] = []
            for c in every:
                if not any(o.state_bytes <= c.state_bytes and o.extra_bytes <= c.extra_bytes
                           for o in front):
                    front.append(c)
            self._model_cache[key] = front
        return self._model_cache[key]

    # -- one colocated set -----------------------------------------------------------------------

    def set_choice(self, roles: tuple[str, ...], n: int) -> SetChoice | None:
        """The fastest layouts of `roles` sharing n devices that fit in memory together (their
        states summed, plus the largest working memory), or None."""
        key = (roles, n)
        if key in self._set_cache:
            return self._set_cache[key]
        fronts = [self.choices(r, n) for r in roles]
        result = None
        if all(fronts):
            best: list = [math.inf, None]
            min_state = [min(c.state_bytes for c in f) for f in fronts]
            min_busy = [min(c.busy for c in f) for f in fronts]

            def search(i: int, picked: list[Choice], busy: float, state: float, extra: float):
                if i == len(fronts):
                    if busy < best[0]:
                        best[0], best[1] = busy, list(picked)
                    return
                rest_state = sum(min_state[i + 1:])
                rest_busy = sum(min_busy[i + 1:])
                for c in fronts[i]:  # fastest first
                    b = busy + c.busy
                    if b + rest_busy >= best[0]:
                        break
                    s, e = state + c.state_bytes, max(extra, c.extra_bytes)
                    if s + rest_state + e > self.budget:
                        continue
                    picked.append(c)
                    search(i + 1, picked, b, s, e)
                    picked.pop()

            search(0, [], 0.0, 0.0, 0.0)
            if best[1] is not None:
                picked = best[1]
                peak = sum(c.state_bytes for c in picked) + max(c.extra_bytes for c in picked)
                result = SetChoice(roles, n, {c.role: c for c in picked}, peak)
        self._set_cache[key] = result
        return result


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _compositions(total: int, sizes: Sequence[Sequence[int]]) -> Iterable[tuple[int, ...]]:
    """Tuples (s_1, ..., s_k) with s_i in sizes[i] and sum == total."""
    if not sizes:
        if total == 0:
            yield ()
        return
    rest_min = sum(s[0] for s in sizes[1:]) if all(sizes[1:]) else math.inf
    for s in sizes[0]:
        if s + rest_min > total:
            break
        for tail in _compositions(total - s, sizes[1:]):
            yield (s,) + tail


def pool_name(roles: Sequence[str]) -> str:
    return "_".join(roles)


def schedule(dataflow: Sequence[Stage], role_pool: Mapping[str, str],
             times: Mapping[str, StageTime]) -> tuple[ScheduledStage, ...]:
    """Each stage in program order starts when its inputs are ready and its pool is free."""
    free: dict[str, float] = {}
    done: dict[str, float] = {}
    out = []
    for st in dataflow:
        ready = max((done[d] for d in st.deps if d in done), default=0.0)
        if st.name not in times:  # a host stage or a role without a device model
            done[st.name] = ready
            continue
        pool = role_pool[st.role]
        start = max(ready, free.get(pool, 0.0))
        end = start + times[st.name].seconds
        free[pool] = done[st.name] = end
        out.append(ScheduledStage(st.name, st.role, pool, start, end, times[st.name].parts))
    return tuple(out)


def plan(
    models: Sequence[ModelSpec],
    workload: Workload,
    target: str | Cluster,
    num_devices: int,
    *,
    dataflow: Sequence[Stage] | None = None,
    host_roles: Sequence[str] = (),
    efficiency: Efficiency | None = None,
    costs: PriceSource | None = None,
    memory_fraction: float = 0.9,
    alternatives: int = 5,
) -> PlanResult:
    """Plans `models` (one per device role) for `num_devices` devices of `target`.

    `dataflow` defaults to `rlhf_dataflow` of the models' roles; `host_roles` (roles without a
    device model: a rule reward, a reference no KL term reads) join the actor's pool and cost
    nothing. Returns the best plan and the best of
    each other placement. Raises PlanError when no placement runs, naming what is missing.
    """
    t0 = time.perf_counter()
    if not isinstance(num_devices, int) or num_devices <= 0:
        raise PlanError(f"num_devices={num_devices!r}: plan for at least one device")
    cluster = target if isinstance(target, Cluster) else cluster_for(target)
    workload.check()
    by_role = {m.role: m for m in models}
    if len(by_role) != len(models) or "actor" not in by_role:
        raise PlanError(f"models {[m.role for m in models]}: give one model per role, with an "
                        "actor")
    unknown = set(by_role) - set(DEVICE_ROLES)
    if unknown:
        raise PlanError(f"unknown roles {sorted(unknown)}; device roles are {DEVICE_ROLES}")
    if "critic" in by_role and not (workload.critic_mini and workload.critic_micro):
        raise PlanError("a critic needs workload.critic_mini and critic_micro (rows per mini- "
                        "and micro-batch of its update)")
    if not 0 < memory_fraction <= 1:
        raise PlanError(f"memory_fraction={memory_fraction}: a fraction in (0, 1]")
    roles = tuple(r for r in DEVICE_ROLES if r in by_role)
    flow = tuple(dataflow or rlhf_dataflow(tuple(roles) + tuple(host_roles),
                                           workload.old_log_prob))
    sim = Simulator(cluster, workload, efficiency, costs)
    budget = memory_fraction * cluster.target.memory_bytes
    search = _Search(by_role, sim, budget)
    _check_some_mesh(search, roles, num_devices, workload)

    g = granularity(num_devices)
    steps = list(range(g, num_devices + 1, g))
    if num_devices not in steps:
        steps.append(num_devices)
    best_by_placement: dict[tuple, Plan] = {}
    n_alloc = 0
    min_alloc: dict[tuple[str, ...], int | None] = {}
    # A model that reads another role's base (a LoRA actor's reference) shares its pool.
    together = [(r, m.shares_base_of) for r, m in by_role.items() if m.shares_base_of]
    placements = [p for p in set_partitions(list(roles))
                  if all(any(a in g and b in g for g in p) for a, b in together)]
    for placement in placements:
        feasible = []
        for group in placement:
            # The sizes the set fits on; the first is its minimum allocation (Algorithm 1's
            # get_min_alloc), and allocations are enumerated from there.
            sizes = [n for n in steps if search.set_choice(group, n) is not None]
            min_alloc[group] = sizes[0] if sizes else None
            feasible.append(sizes)
        if not all(feasible):
            continue
        for alloc in _compositions(num_devices, feasible):
            n_alloc += 1
            p = _build_plan(placement, alloc, search, flow, host_roles, workload, cluster)
            key = p.placement_key
            if key not in best_by_placement or p.iteration_s < best_by_placement[key].iteration_s:
                best_by_placement[key] = p
    if not best_by_placement:
        raise PlanError(_no_fit_message(search, roles, num_devices, cluster, budget))
    ranked = sorted(best_by_placement.values(), key=lambda p: p.iteration_s)
    return PlanResult(ranked[0], ranked[1:1 + alternatives], len(placements), n_alloc,
                      time.perf_counter() - t0, cluster, workload,
                      {pool_name(group): n for group, n in min_alloc.items()})


def _build_plan(placement, alloc, search: _Search, flow, host_roles, workload: Workload,
                cluster: Cluster) -> Plan:
    sets = {}
    pools = {}
    role_pool = {}
    times: dict[str, StageTime] = {}
    for group, size in zip(placement, alloc):
        name = pool_name(group)
        sc = search.set_choice(group, size)
        sets[name] = sc
        pool_roles = list(group)
        if "actor" in group:
            pool_roles += [r for r in host_roles if r not in pool_roles]
        pools[name] = (size, tuple(pool_roles))
        for role in group:
            role_pool[role] = name
            times.update(sc.choices[role].stages)
    sched = schedule(flow, role_pool, times)
    iteration = max((s.end for s in sched), default=0.0)
    return Plan(pools, sets, sched, iteration, workload.tokens, cluster.target.memory_bytes)


def _check_some_mesh(search: _Search, roles, n: int, workload: Workload) -> None:
    """PlanError when some model has no mesh at all over n devices (memory aside), naming the
    divisibility rules and device counts that work."""
    for role in roles:
        if not search.layouts(role, n):
            model = search.models[role]
            cfg = model.config
            need = (f"data x fsdp must divide the micro-batch of {workload.micro(role)} "
                    "sequences and " if model.trainable else "")
            near = [m for m in range(max(1, n - 8), n + 9)
                    if m != n and search.layouts(role, m)][:4]
            raise PlanError(
                f"no mesh over {n} devices can run {model.label}: {need}tensor "
                f"must divide its {cfg.num_heads} heads (and fsdp its hidden size "
                f"{cfg.hidden_size}); device counts that work nearby: "
                f"{', '.join(map(str, near)) or 'none'}")


def _no_fit_message(search: _Search, roles, n: int, cluster: Cluster, budget: float) -> str:
    t = cluster.target
    alone = []
    for role in roles:
        fits = next((m for m in range(1, n + 1) if search.set_choice((role,), m)), None)
        alone.append(f"{search.models[role].label}: "
                     + (f"{fits} device(s)" if fits else f"does not fit on {n}"))
    total = sum(search.sim.costs.state(search.models[r], MeshLayout(fsdp=1)).total
                for r in roles)
    return (f"the models fit on no allocation of {n} x {t.name} ({t.memory_bytes / 1e9:.0f} GB "
            f"each, {budget / 1e9:.0f} GB usable): alone, each needs at least "
            f"{'; '.join(alone)}; their parameters and optimizer state alone take "
            f"{total / 1e9:.0f} GB. Use more devices, a target with more memory, remat "
            "(model.remat_policy=full) or a smaller micro-batch")

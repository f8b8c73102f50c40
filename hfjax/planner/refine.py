"""Re-pricing a search's finalists with another cost source.

The search (`hfjax.planner.search.plan`) prices thousands of layouts; compiling a program for
each would take hours. `reprice` takes its result (the best plan and the best plan of each
next placement, ranked by the closed forms) and prices exactly those plans again with another
`PriceSource`, typically `hfjax.planner.compiled.CompiledPrices`: every model keeps the layout,
decode layout and generation batch the search chose for it, its stages are simulated again
from the new figures, the schedule is rebuilt, and the plans are ranked anew. Only the top
1 + `alternatives` plans are compiled; a plan the closed forms ranked lower is never
reconsidered.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from hfjax.planner.pricing import ModelSpec, PriceSource
from hfjax.planner.search import (
    DEVICE_ROLES,
    Plan,
    PlanResult,
    SetChoice,
    Stage,
    _Search,
    rlhf_dataflow,
    schedule,
)
from hfjax.planner.simulator import Efficiency, Simulator


def reprice(result: PlanResult, models: Sequence[ModelSpec], costs: PriceSource, *,
            efficiency: Efficiency | None = None, host_roles: Sequence[str] = (),
            dataflow: Sequence[Stage] | None = None,
            memory_fraction: float = 0.9) -> PlanResult:
    """`result` with its best plan and alternatives priced by `costs` and ranked again
    (fastest first); the arguments are those `plan` was called with. A plan's pools, meshes and
    decode layouts are unchanged; its stage times, working memory and peaks are `costs`'."""
    by_role = {m.role: m for m in models}
    sim = Simulator(result.cluster, result.workload, efficiency, costs)
    search = _Search(by_role, sim, memory_fraction * result.cluster.target.memory_bytes)
    roles = tuple(r for r in DEVICE_ROLES if r in by_role)
    flow = tuple(dataflow or rlhf_dataflow(roles + tuple(host_roles),
                                           result.workload.old_log_prob))
    plans = [_reprice_plan(p, search, flow) for p in [result.best, *result.alternatives]]
    plans.sort(key=lambda p: p.iteration_s)
    return dataclasses.replace(result, best=plans[0], alternatives=plans[1:])


def _reprice_plan(p: Plan, search: _Search, flow) -> Plan:
    sets = {}
    role_pool = {}
    times = {}
    for name, sc in p.sets.items():
        choices = {}
        for role, old in sc.choices.items():
            again = search.evaluate(role, old.layout, old.tensor_g, old.engine)
            choices[role] = next(c for c in again if c.gen_rows == old.gen_rows)
            role_pool[role] = name
            times.update(choices[role].stages)
        peak = (sum(c.state_bytes for c in choices.values())
                + max(c.extra_bytes for c in choices.values()))
        sets[name] = SetChoice(sc.roles, sc.size, choices, peak)
    sched = schedule(flow, role_pool, times)
    iteration = max((s.end for s in sched), default=0.0)
    return dataclasses.replace(p, sets=sets, schedule=sched, iteration_s=iteration)

"""The rollout pool of an asynchronous run: devices that only generate, with their own copy of
the actor's weights (`hfjax.workers.rollout`), beside the pools that train.

A placement gives the rollout a pool of its own in two ways:

- a mapping with a pool that lists `rollout` without `actor`, e.g.
  ``gen=4:rollout;train=4:actor+ref+reward``: any `async_rollout.max_staleness`, 0 included
  (the synchronous loop on two pools: generate on one, train on the other, in turn);
- `split` with `async_rollout.max_staleness` >= 1: half the devices generate (`rollout_pool`),
  every other role is colocated on the rest (`actor_pool`).

Without one (colocate, standalone, split at K = 0, a mapping whose `rollout` sits with the
actor) the actor generates on its own devices, as in the synchronous loop; K >= 1 is refused
there, since nothing could run while the trainer updates.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from hfjax.controller.placement import build_placement, parse_mapping
from hfjax.parallel.mesh import ResourcePool, carve_pools, sorted_devices

ROLE = "rollout"
SPLIT_POOL = "rollout_pool"
_FIX = ("use --config.placement=split, or a mapping with a pool of its own for the rollout, "
        "e.g. 'gen=4:rollout;train=4:actor+ref+reward'")


def _mapping(placement: Any) -> dict[str, dict[str, Any]] | None:
    if isinstance(placement, str):
        return parse_mapping(placement) if "=" in placement else None
    if hasattr(placement, "items"):
        return {name: dict(entry.items()) for name, entry in placement.items()}
    return None


def rollout_pool_name(placement: Any, max_staleness: int) -> str | None:
    """The pool that only generates under this placement and staleness bound, or None (the
    actor generates on its own devices)."""
    mapping = _mapping(placement)
    if mapping is None:
        return SPLIT_POOL if placement == "split" and max_staleness >= 1 else None
    for name, entry in mapping.items():
        roles = list(entry.get("roles") or ())
        if ROLE in roles and "actor" not in roles:
            return name
    return None


def rollout_pool_problem(placement: Any, max_staleness: int) -> str | None:
    """Why `async_rollout.max_staleness` cannot run on this placement (None: it can); read
    without devices, so a bad setting is refused before anything is built."""
    if max_staleness >= 1 and rollout_pool_name(placement, max_staleness) is None:
        return (f"async_rollout.max_staleness={max_staleness} needs a rollout pool disjoint "
                f"from the trainer's, and placement {placement!r} has none; {_FIX}, or set "
                "--config.async_rollout.max_staleness=0")
    if rollout_pool_name(placement, max_staleness) is not None:
        mapping = _mapping(placement)
        if mapping is not None:
            roles = mapping[rollout_pool_name(placement, max_staleness)].get("roles") or ()
            if list(roles) != [ROLE]:
                return (f"placement pool {rollout_pool_name(placement, max_staleness)!r} lists "
                        f"{list(roles)}: a rollout pool holds the rollout alone; move the other "
                        "roles to a training pool in --config.placement")
    return None


def resolve_pools(placement: Any, active_roles: Iterable[str], devices: Sequence[Any],
                  max_staleness: int) -> dict[str, ResourcePool]:
    """{role: ResourcePool} for the active roles, plus "rollout" when the placement gives the
    rollout a pool of its own (`rollout_pool_name`); the placement's own resolution otherwise."""
    devices = sorted_devices(devices)
    active = tuple(active_roles)
    name = rollout_pool_name(placement, max_staleness)
    if name is None:
        return build_placement(placement, active, len(devices)).resolve(devices)
    mapping = _mapping(placement)
    if mapping is None:  # split: generation on half the devices, training on the rest
        half = len(devices) // 2
        if half < 1:
            raise ValueError(f"async_rollout on placement 'split' needs 2 devices or more, "
                             f"there are {len(devices)}; run on more devices (--cpu_devices=2 "
                             "on CPU) or set --config.async_rollout.max_staleness=0")
        mapping = {SPLIT_POOL: {"size": half, "roles": [ROLE]},
                   "actor_pool": {"size": len(devices) - half, "roles": list(active)}}
    if all("devices" in e for e in mapping.values()):
        by_id = {d.id: d for d in devices}
        pools = {n: ResourcePool(n, tuple(by_id[i] for i in e["devices"]))
                 for n, e in mapping.items()}
    else:
        sizes = {n: int(e["size"]) for n, e in mapping.items()}
        if sum(sizes.values()) > len(devices):
            raise ValueError(f"placement {placement!r} needs {sum(sizes.values())} devices, "
                             f"only {len(devices)} are available; shrink the pools")
        pools = carve_pools(sizes, devices)
    rest = {n: {"devices": [d.id for d in pools[n].devices], "roles": e["roles"]}
            for n, e in mapping.items() if n != name}
    out = build_placement(rest, active, len(devices)).resolve(devices)
    out[ROLE] = pools[name]
    return out


def trainer_pools(pools: Mapping[str, ResourcePool]) -> dict[str, ResourcePool]:
    """`pools` without the rollout's (the roles a placement knows)."""
    return {r: p for r, p in pools.items() if r != ROLE}

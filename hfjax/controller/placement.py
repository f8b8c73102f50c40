"""Placement: which resource pool each role of an RLHF dataflow runs on.

Roles on the same pool are colocated and take turns on its devices; roles on different pools run
concurrently. A placement is either one of the paper's three named modes or an explicit mapping
from config::

    {"gen": {"size": 4, "roles": ["actor", "ref"]},
     "score": {"size": 4, "roles": ["critic", "reward"]}}

A pool entry may give ``"devices": [ids...]`` instead of ``"size"`` to pin exact devices.

On the command line the same mapping is a string of ``pool=size:role+role`` items::

    --config.placement="gen=4:actor+ref;score=4:critic+reward"

The actor generates too, with its own weights on its own devices (the hybrid engine), so there is
no separate rollout role. A pool may still list ``rollout`` next to ``actor`` (an alias, dropped);
listed without ``actor`` it is an error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax

from hfjax.parallel.mesh import ResourcePool, carve_pools, sorted_devices

MODES: tuple[str, ...] = ("colocate", "split", "standalone")

# Which side of the dataflow each role sits on, in registration order. `split` puts the
# generating side (the actor and the models that read its samples token by token, like the
# reference) on one half of the devices and the scoring side (critics, reward and cost models)
# on the other. The built-in roles are registered below; an algorithm with a role of its own
# registers it (`place_role`, or `hfjax.workers.groups.register_role` with its builder) and
# it places like these.
SIDES: tuple[str, ...] = ("generate", "score")
_ROLE_SIDES: dict[str, str] = {}


def place_role(name: str, side: str = "score") -> None:
    """Makes `name` a role that placements accept, on `side` ("generate" or "score") of a
    `split` placement. Registering a known role again with the same side is a no-op."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"role name {name!r} must be a Python identifier, e.g. 'cost_critic'")
    if side not in SIDES:
        raise ValueError(f"role {name!r}: side {side!r} is not one of {', '.join(SIDES)}")
    if _ROLE_SIDES.get(name, side) != side:
        raise ValueError(f"role {name!r} is already registered on the {_ROLE_SIDES[name]!r} "
                         f"side, not {side!r}")
    _ROLE_SIDES[name] = side


def known_roles() -> tuple[str, ...]:
    """Every registered role, in registration order."""
    return tuple(_ROLE_SIDES)


for _role in ("actor", "ref"):
    place_role(_role, "generate")

# Names a placement accepts for a role they stand for, in that role's pool only.
ROLE_ALIASES = {"rollout": "actor"}
for _role in ("critic", "reward", "reward_model", "cost_model", "cost_critic"):
    place_role(_role, "score")


def _split_groups() -> tuple[tuple[str, tuple[str, ...]], ...]:
    by_side = {side: tuple(r for r, s in _ROLE_SIDES.items() if s == side) for side in SIDES}
    return (("actor_pool", by_side["generate"]), ("critic_pool", by_side["score"]))


def _standalone_groups() -> tuple[tuple[str, tuple[str, ...]], ...]:
    # Every model gets its own pool (the actor's also generates: the hybrid engine).
    return tuple((f"{r}_pool", (r,)) for r in _ROLE_SIDES)


@dataclasses.dataclass(frozen=True)
class PoolPlan:
    """One pool of a placement: either a device count or explicit device ids, and its roles."""

    roles: tuple[str, ...]
    size: int | None = None
    device_ids: tuple[int, ...] | None = None

    @property
    def n_devices(self) -> int:
        """Returns how many devices the pool takes."""
        return len(self.device_ids) if self.device_ids is not None else int(self.size or 0)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Pools by name, each with its roles; `role_pool` maps every active role to its pool name."""

    pools: dict[str, PoolPlan]
    active_roles: tuple[str, ...]
    source: str = "mapping"

    @property
    def role_pool(self) -> dict[str, str]:
        """Returns {role: pool name} for every active role."""
        out = {}
        for name, plan in self.pools.items():
            for role in plan.roles:
                if role in self.active_roles:
                    out[role] = name
        return out

    @classmethod
    def from_mode(cls, mode: str, active_roles: Iterable[str], n_devices: int) -> Placement:
        """Returns the placement of `mode` (colocate, split, standalone) over `n_devices`.

        Groups with no active role get no pool, and the devices are shared equally among the
        remaining pools; any remainder goes to the actor's pool, which both trains and generates.
        """
        active = _check_roles(active_roles)
        if mode == "colocate":
            return cls({"global": PoolPlan(active, size=n_devices)}, active, mode)
        if mode not in MODES:
            raise ValueError(
                f"unknown placement mode {mode!r}; use one of {', '.join(MODES)} "
                "or a mapping {pool: {'size': n, 'roles': [...]}}"
            )
        table = _split_groups() if mode == "split" else _standalone_groups()
        groups = [(name, tuple(r for r in roles if r in active)) for name, roles in table]
        groups = [(name, roles) for name, roles in groups if roles]
        if len(groups) > n_devices:
            raise ValueError(
                f"placement {mode!r} needs {len(groups)} pools ({', '.join(n for n, _ in groups)})"
                f" but only {n_devices} devices are available; use 'colocate' or more devices"
            )
        share, extra = divmod(n_devices, len(groups))
        pools = {}
        for i, (name, roles) in enumerate(groups):
            pools[name] = PoolPlan(roles, size=share + (extra if i == 0 else 0))
        return cls(pools, active, mode)

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any], active_roles: Iterable[str]) -> Placement:
        """Returns the placement given by {pool: {"size" | "devices": ..., "roles": [...]}}."""
        active = _check_roles(active_roles)
        pools: dict[str, PoolPlan] = {}
        owner: dict[str, str] = {}
        for name, entry in _items(mapping):
            fields = dict(_items(entry)) if hasattr(entry, "items") else None
            if fields is None:
                raise ValueError(
                    f"placement pool {name!r}: expected {{'size': n, 'roles': [...]}}, "
                    f"got {entry!r}"
                )
            unknown = set(fields) - {"size", "devices", "roles"}
            if unknown:
                raise ValueError(
                    f"placement pool {name!r}: unknown keys {sorted(unknown)}; "
                    "allowed keys are size, devices, roles"
                )
            if ("size" in fields) == ("devices" in fields):
                raise ValueError(
                    f"placement pool {name!r}: give exactly one of 'size' (a device count) or "
                    "'devices' (a list of device ids)"
                )
            roles = fields.get("roles")
            if isinstance(roles, str) or not isinstance(roles, Sequence) or not roles:
                raise ValueError(
                    f"placement pool {name!r}: 'roles' must be a non-empty list of roles "
                    f"from {', '.join(known_roles())}, got {roles!r}"
                )
            roles = _check_roles(_drop_aliases(roles, name), where=f"placement pool {name!r}")
            for role in roles:
                if role in owner:
                    raise ValueError(
                        f"role {role!r} is on two pools, {owner[role]!r} and {name!r}; "
                        "a role runs on exactly one pool, remove it from one of them"
                    )
                owner[role] = name
            if "size" in fields:
                size = fields["size"]
                if not isinstance(size, int) or size <= 0:
                    raise ValueError(
                        f"placement pool {name!r}: size must be a positive int, got {size!r}"
                    )
                pools[name] = PoolPlan(roles, size=size)
            else:
                ids = tuple(int(i) for i in fields["devices"])
                if not ids or len(set(ids)) != len(ids):
                    raise ValueError(
                        f"placement pool {name!r}: 'devices' must list distinct device ids, "
                        f"got {list(ids)}"
                    )
                pools[name] = PoolPlan(roles, device_ids=ids)
        if any(p.size is not None for p in pools.values()) and any(
            p.device_ids is not None for p in pools.values()
        ):
            raise ValueError(
                "placement mixes 'size' and 'devices' pools; give every pool a size, "
                "or every pool its device ids"
            )
        return cls(pools, active, "mapping")

    def check(self, n_devices: int) -> None:
        """Raises ValueError if an active role has no pool or the pools don't fit the devices."""
        role_pool = self.role_pool
        for role in self.active_roles:
            if role not in role_pool:
                raise ValueError(
                    f"role {role!r} has no pool in placement {self.describe()}; add it to a pool"
                )
        seen: dict[int, str] = {}
        for name, plan in self.pools.items():
            for i in plan.device_ids or ():
                if i in seen:
                    raise ValueError(
                        f"pools {seen[i]!r} and {name!r} overlap on device {i}; "
                        "pools must be disjoint"
                    )
                seen[i] = name
        total = sum(plan.n_devices for plan in self.pools.values())
        if total > n_devices:
            raise ValueError(
                f"placement {self.describe()} needs {total} devices, only {n_devices} are "
                "available; shrink the pools"
            )

    def describe(self) -> str:
        """Returns a one-line summary, e.g. ``split{actor_pool=4:[actor,ref], ...}``."""
        parts = []
        for name, plan in self.pools.items():
            where = plan.size if plan.device_ids is None else list(plan.device_ids)
            parts.append(f"{name}={where}:[{','.join(plan.roles)}]")
        return f"{self.source}{{{', '.join(parts)}}}"

    def resolve(self, devices: Sequence[Any] | None = None) -> dict[str, ResourcePool]:
        """Returns {role: ResourcePool} for every active role; colocated roles share one object."""
        devices = sorted_devices(devices)
        self.check(len(devices))
        if all(plan.device_ids is not None for plan in self.pools.values()) and self.pools:
            by_id = {d.id: d for d in devices}
            pools = {}
            for name, plan in self.pools.items():
                missing = [i for i in plan.device_ids or () if i not in by_id]
                if missing:
                    raise ValueError(
                        f"placement pool {name!r}: device ids {missing} don't exist; available "
                        f"ids are {sorted(by_id)}"
                    )
                pools[name] = ResourcePool(name, tuple(by_id[i] for i in plan.device_ids or ()))
        else:
            pools = carve_pools({n: p.n_devices for n, p in self.pools.items()}, devices)
        return {role: pools[name] for role, name in self.role_pool.items()}


def resolve_placement(
    mode_or_mapping: str | Mapping[str, Any],
    active_roles: Iterable[str],
    devices: Sequence[Any] | None = None,
) -> dict[str, ResourcePool]:
    """Returns {role: ResourcePool} for `active_roles` under a mode name or explicit mapping."""
    devices = sorted_devices(jax.devices() if devices is None else devices)
    placement = build_placement(mode_or_mapping, active_roles, len(devices))
    return placement.resolve(devices)


def build_placement(
    mode_or_mapping: str | Mapping[str, Any], active_roles: Iterable[str], n_devices: int
) -> Placement:
    """Returns the Placement for a mode name or an explicit mapping, checked against n_devices."""
    if isinstance(mode_or_mapping, str) and "=" in mode_or_mapping:
        placement = Placement.from_mapping(parse_mapping(mode_or_mapping), active_roles)
    elif isinstance(mode_or_mapping, str):
        placement = Placement.from_mode(mode_or_mapping, active_roles, n_devices)
    elif hasattr(mode_or_mapping, "items"):
        placement = Placement.from_mapping(mode_or_mapping, active_roles)
    else:
        raise TypeError(
            f"placement must be one of {', '.join(MODES)} or a mapping "
            f"{{pool: {{'size': n, 'roles': [...]}}}}, got {mode_or_mapping!r}"
        )
    placement.check(n_devices)
    return placement


def parse_mapping(text: str) -> dict[str, dict[str, Any]]:
    """{pool: {"size": n, "roles": [...]}} from ``"gen=4:actor+ref;score=4:critic+reward"``."""
    out: dict[str, dict[str, Any]] = {}
    for item in filter(None, (x.strip() for x in text.split(";"))):
        try:
            name, rest = item.split("=", 1)
            size, roles = rest.split(":", 1)
            if name.strip() in out:
                raise KeyError(name.strip())
            out[name.strip()] = {
                "size": int(size),
                "roles": [r.strip() for r in roles.split("+") if r.strip()],
            }
        except ValueError:
            raise ValueError(
                f"placement item {item!r}: write pool=size:role+role, e.g. "
                "'gen=4:actor+ref;score=4:critic+reward'"
            ) from None
        except KeyError as err:
            raise ValueError(f"placement {text!r}: pool {err.args[0]!r} is given twice") from None
    return out


def _drop_aliases(roles: Sequence[str], pool: str) -> list[str]:
    """`roles` without the aliases (`ROLE_ALIASES`) of a role the pool also lists; ValueError
    for an alias without its role."""
    for alias, role in ROLE_ALIASES.items():
        if alias in roles and role not in roles:
            raise ValueError(
                f"placement pool {pool!r}: {alias!r} is not a role of its own: the {role} "
                f"generates with its own weights on its own devices, so {alias!r} runs "
                f"wherever {role!r} does; put {role!r} in this pool or drop {alias!r}")
    return [r for r in roles if r not in ROLE_ALIASES]


def _check_roles(roles: Iterable[str], where: str = "active roles") -> tuple[str, ...]:
    roles = tuple(roles)
    for role in roles:
        if role not in _ROLE_SIDES:
            raise ValueError(f"{where}: unknown role {role!r}; valid roles are "
                             f"{', '.join(known_roles())} (an algorithm's own role must be "
                             "registered first: hfjax.workers.groups.register_role)")
    if len(set(roles)) != len(roles):
        raise ValueError(f"{where}: a role is listed twice in {list(roles)}")
    if not roles:
        raise ValueError(f"{where}: no roles given; list at least one of "
                         f"{', '.join(known_roles())}")
    return roles


def _items(mapping: Any) -> list[tuple[str, Any]]:
    # ml_collections ConfigDicts are not `Mapping`s but do provide items().
    return list(mapping.items())

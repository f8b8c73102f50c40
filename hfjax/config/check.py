"""Running the checks: `check_config` (a train config, no devices, nothing written),
`check_flags` (an entry point's flags) and `validate_config` (plus what needs the devices)."""

from __future__ import annotations

import difflib
from collections.abc import Iterator, Mapping
from typing import Any

from hfjax.config.flags import FLAG_RULES, flag_checks
from hfjax.config.keys import LEAF_MAPPINGS, OPTIONAL_KEYS, TRAIN_KEYS
from hfjax.config.rules import MODEL_ROLES, TRAIN_RULES, active_roles, placement_of, run_roles
from hfjax.settings.values import ConfigError


def config_items(cfg, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) for every leaf of a (nested) config."""
    for k, v in cfg.items():
        key = prefix + k
        if hasattr(v, "items") and key not in LEAF_MAPPINGS:
            yield from config_items(v, key + ".")
        else:
            yield key, v


def check_config(cfg) -> None:
    """Checks every key of a train config and every rule between keys, without devices and
    without writing anything; raises ConfigError naming the first problem."""
    items = dict(config_items(cfg))
    if "algorithm" in items:  # imports a user algorithm's module, which may register keys
        problem = TRAIN_KEYS["algorithm"](items["algorithm"])
        if problem:
            raise ConfigError(f"algorithm={items['algorithm']!r}: {problem}; set "
                              "--config.algorithm")
    unknown = [k for k in items if k not in TRAIN_KEYS]
    if unknown:
        k = unknown[0]
        close = difflib.get_close_matches(k, TRAIN_KEYS, n=1)
        hint = f"did you mean {close[0]}?" if close else "remove it"
        raise ConfigError(f"unknown config key {k}; {hint} (every key is declared in "
                          "hfjax/config/keys.py TRAIN_KEYS)")
    missing = [k for k in TRAIN_KEYS if k not in items and k not in OPTIONAL_KEYS]
    if missing:
        raise ConfigError(f"the config has no key {missing[0]}; derive configs from "
                          "configs/ppo_arith.py, which sets every key")
    for key, check in TRAIN_KEYS.items():
        if key not in items or key == "algorithm":
            continue  # an optional key left out, or checked above
        problem = check(items[key])
        if problem:
            raise ConfigError(f"{key}={items[key]!r}: {problem}; set --config.{key}")
    for rule in TRAIN_RULES:
        problem = rule(cfg)
        if problem:
            raise ConfigError(problem)


def check_flags(entry: str, values: Mapping[str, Any]) -> None:
    """Checks an entry point's flags (`flag_checks(entry)`, then `FLAG_RULES[entry]`); raises
    ConfigError naming the first problem."""
    for name, check in flag_checks(entry).items():
        if name not in values:
            continue
        problem = check(values[name])
        if problem:
            raise ConfigError(f"--{name}={_show(values[name])}: {problem}")
    for rule in FLAG_RULES.get(entry, ()):
        problem = rule(values)
        if problem:
            raise ConfigError(problem)


def _show(v) -> str:
    if isinstance(v, (list, tuple)):
        return ",".join(map(str, v)) or "''"
    return "''" if v == "" else str(v)


def validate_config(cfg):
    """`check_config`, then the checks that need the devices: placement, meshes and batch
    splits. Returns (Algorithm, {role: ResourcePool})."""
    import jax

    from hfjax.algorithms.registry import get_algorithm
    from hfjax.controller.async_pools import resolve_pools
    from hfjax.engine.update import check_mini_batching
    from hfjax.parallel.mesh import MeshSpec, dp_size
    from hfjax.workers.groups import needs_ref

    check_config(cfg)
    algo = get_algorithm(cfg.algorithm)
    roles = run_roles(algo, cfg)
    n_seq = cfg.data.train_batch_size * cfg.rollout.n
    # A rollout pool of its own (asynchronous rollout) is an extra entry, "rollout".
    pools = resolve_pools(placement_of(cfg), active_roles(algo, cfg), jax.devices(),
                          cfg.async_rollout.max_staleness)
    dp = dp_size(MeshSpec.parse(cfg.actor.mesh).build(pools["actor"].devices, "actor"))
    check_mini_batching(n_seq, cfg.actor.ppo_mini_batch_size * cfg.rollout.n,
                        cfg.actor.ppo_micro_batch_size, dp, "actor")
    if cfg.sft.steps > 0:
        check_mini_batching(cfg.sft.batch_size, cfg.sft.batch_size, cfg.sft.micro_batch_size,
                            dp, "sft (warm start)")
    if needs_ref(cfg, roles):
        if cfg.actor.lora.rank and pools["ref"].name != pools["actor"].name:
            raise ConfigError(
                f"actor.lora: the reference reads the actor's frozen base weights, so it runs "
                f"on the actor's pool, not on pool {pools['ref'].name!r}; place ref with the "
                "actor (e.g. --config.placement=colocate) or set actor.lora.rank=0")
        # Built only after the warm start, so a bad mesh must be caught here, not there.
        MeshSpec.parse(cfg.ref.mesh).build(pools["ref"].devices, "ref")
    for critic in ("critic", "cost_critic"):
        if critic in roles:
            c = cfg[critic]
            dpc = dp_size(MeshSpec.parse(c.mesh).build(pools[critic].devices, critic))
            check_mini_batching(n_seq, c.ppo_mini_batch_size * cfg.rollout.n,
                                c.ppo_micro_batch_size, dpc, critic)
    for role in MODEL_ROLES:
        if role in roles:
            MeshSpec.parse(cfg[role].mesh).build(pools[role].devices, role)
    if "judge" in roles:
        MeshSpec.parse(cfg.reward.judge.mesh).build(pools["judge"].devices, "judge")
    return algo, pools

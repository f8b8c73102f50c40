"""The rollout group of an asynchronous run: a second copy of the actor's weights, in its
decode layout, on a pool of its own (docs/async.md).

It is an `ActorRollout` that never trains: its params are its decode layout (no hybrid engine),
its generate results stay on its own mesh until the trainer's step takes them
(`hfjax.run.async_loop`), and its weights arrive by
`push`, explicit device-to-device transfers from the trainer's mesh onto this group's
shardings (`hfjax.parallel.transfer.transfer`, the hybrid engine's machinery between two
meshes). A push builds a new buffer beside the one decoding reads; the caller swaps them
between generate calls (double buffering), so decoding never waits on a transfer.
"""

from __future__ import annotations

import time

import jax
from flax import nnx

from hfjax.engine.continuous import rollout_sampler
from hfjax.engine.layout_choice import actor_rules_and_engine
from hfjax.parallel import sharding as shd
from hfjax.parallel.mesh import ResourcePool
from hfjax.parallel.transfer import transfer
from hfjax.workers.actor import ActorRollout


def build_rollout(cfg, actor: ActorRollout, pool: ResourcePool, pad_id: int,
                  eos_ids: tuple[int, ...]) -> ActorRollout:
    """The rollout group on `pool`: the actor's current weights, placed in the decode layout
    (`rollout.mesh` when the actor has a hybrid engine, else the actor's mesh spec and
    training rules) on the pool's devices; results stay there (the trainer's step takes them
    home, so that across processes the generating process never waits on the trainer's)."""
    spec = actor.rollout
    model = actor.model()
    if actor.hybrid is not None:
        mesh_spec, rules = spec.decode_mesh, actor.hybrid.decode_rules
    else:
        mesh_spec = cfg.actor.mesh
        rules, _ = actor_rules_and_engine(pool.mesh(mesh_spec), cfg.actor.rules, "",
                                          nnx.state(model))
    mesh = pool.mesh(mesh_spec)
    sampler = rollout_sampler(model, spec, mesh=mesh, max_prompt_len=cfg.data.max_prompt_length,
                              pad_id=pad_id, rules=None, param_rules=rules)
    group = ActorRollout("rollout", pool, mesh_spec, model, rules=rules, sampler=sampler,
                         spec=actor.spec, rollout=spec, eos_ids=eos_ids)
    group.trim = False  # a host read of the responses' length: done when the step takes them
    return group


def param_bytes(params) -> int:
    """The bytes of a params tree (what one push moves)."""
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params)))


def push(actor: ActorRollout, rollout: ActorRollout):
    """(the actor's params on the rollout group's shardings, seconds). Each leaf moves device
    to device (`transfer`); the result is a new buffer, the one decoding reads is untouched.
    The time waits for the copies (the caller's update has already finished)."""
    t0 = time.perf_counter()
    with jax.transfer_guard("allow"):
        params = jax.tree.map(lambda sh, var: var.replace(transfer(var.get_value(), sh)),
                              rollout.param_shardings, actor.params, is_leaf=shd.is_variable)
    jax.block_until_ready(params)
    return params, time.perf_counter() - t0

"""The rollout group of an asynchronous run: a second copy of the actor's weights, in its
decode layout, on a pool of its own (docs/async.md).

It is an `ActorRollout` that never trains: its params are its decode layout (no hybrid engine),
its generate results stay on its own mesh until the trainer's step takes them
(`hfjax.run.async_loop`), and its weights arrive by
`push`, explicit device-to-device transfers from the trainer's mesh onto this group's
shardings (`hfjax.parallel.transfer.transfer`, the hybrid engine's machinery between two
meshes). A push builds a new buffer beside the one decoding reads; the caller swaps them
between generate calls (double buffering), so decoding never waits on a transfer.

With partial rollouts (`generate_partial`) a batch decodes its first `partial_column` response
tokens under one version and its rows still decoding there continue under the next
(`hfjax.engine.partial`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import jax
import numpy as np
from flax import nnx

from hfjax.controller.batch import Batch
from hfjax.engine import partial
from hfjax.engine.continuous import rollout_sampler
from hfjax.engine.layout_choice import actor_rules_and_engine
from hfjax.engine.token_select import GenerateOutput
from hfjax.parallel import sharding as shd
from hfjax.parallel.mesh import ResourcePool, batch_sharding
from hfjax.parallel.transfer import transfer
from hfjax.workers.actor import ActorRollout


def build_rollout(cfg, actor: ActorRollout, pool: ResourcePool, pad_id: int,
                  eos_ids: tuple[int, ...], *, partial_rollout: bool = False) -> ActorRollout:
    """The rollout group on `pool`: the actor's current weights, placed in the decode layout
    (`rollout.mesh` when the actor has a hybrid engine, else the actor's mesh spec and
    training rules) on the pool's devices; results stay there (the trainer's step takes them
    home, so that across processes the generating process never waits on the trainer's).
    With `partial_rollout` its sampler takes a prompt and a response prefix as one prompt."""
    spec = actor.rollout
    model = actor.model()
    if actor.hybrid is not None:
        mesh_spec, rules = spec.decode_mesh, actor.hybrid.decode_rules
    else:
        mesh_spec = cfg.actor.mesh
        rules, _ = actor_rules_and_engine(pool.mesh(mesh_spec), cfg.actor.rules, "",
                                          nnx.state(model))
    mesh = pool.mesh(mesh_spec)
    longest = cfg.data.max_prompt_length + (spec.response_length if partial_rollout else 0)
    sampler = rollout_sampler(model, spec, mesh=mesh, max_prompt_len=longest,
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


def partial_column(response_length: int) -> int:
    """The response column where a partial rollout's batch switches to the next version:
    halfway (a function of the config only, so that runs are reproducible)."""
    return response_length // 2


def continuation_seeds(seeds, n: int, at: int) -> np.ndarray:
    """[rows] seeds of the rows' continuations after column `at`: sample j of a prompt with
    seed s continues with a seed mixed from (s, j, at), so that its draws after the switch
    are not those of its first tokens again."""
    return np.asarray([np.random.SeedSequence([int(s) & 0xFFFFFFFF, j, at]).generate_state(1)[0]
                       for s in np.asarray(seeds) for j in range(n)], np.uint32)


def generate_partial(group: ActorRollout, prompts: Batch, first, first_version: int,
                     second: Callable[[], object], second_version: int) -> tuple[Batch, float]:
    """(`group.generate(prompts)` with its response columns from `partial_column` on drawn
    under `second()`'s weights in every row still decoding there, the fraction of such rows).

    The first columns are decoded under `first` (version `first_version`); `second()` is
    called once they are done and returns the next version's weights (waiting for its push).
    The batch carries `token_versions` [rows, response_length] (-1 on padding)."""
    head = partial_head(group, prompts, first)
    return partial_rest(group, prompts, head, first_version, second(), second_version)


def partial_head(group: ActorRollout, prompts: Batch, first):
    """The first `partial_column` response columns of `prompts` decoded under `first` (a
    generate output on the rollout pool, dispatched, not waited for)."""
    if "image_grids" in prompts:  # its sampler calls would go without the pictures
        raise ValueError("partial rollouts of prompts with images are not built; set "
                         "--config.async_rollout.partial_rollout=False")
    params = group.sampling_params()
    at = partial_column(params.max_new_tokens)
    return group.sampler.generate(first, prompts["prompts"], prompts["prompt_mask"],
                                  dataclasses.replace(params, max_new_tokens=at),
                                  seed=prompts["seeds"])


def partial_rest(group: ActorRollout, prompts: Batch, head, first_version: int, second,
                 second_version: int) -> tuple[Batch, float]:
    """`generate_partial` from its `head` on: the rows still decoding continue under `second`
    (version `second_version`). The head's and the continuation's rows come to the host of
    every process (`partial.cut`, `partial.continue_rows`), so across processes each reads
    the rollout pool's rows, and the finished rows go back to the rollout pool."""
    params = group.sampling_params()
    at, n = partial_column(params.max_new_tokens), params.n
    ids, mask, seeds = prompts["prompts"], prompts["prompt_mask"], prompts["seeds"]
    rows, live = partial.cut(head, at, first_version, group.eos_ids)
    rows = partial.continue_rows(group.sampler, second, ids, mask, n, rows, live,
                                 second_version, params, continuation_seeds(seeds, n, at))
    # The finished rows' upload back to the rollout pool, where `generate` leaves its rows.
    sharding = batch_sharding(group.mesh)
    with jax.transfer_guard("allow"):
        tokens, rmask, lps, versions = (jax.device_put(x, sharding) for x in rows)
    batch = group.respond(prompts, GenerateOutput(tokens, rmask, lps), n)
    return batch.union(Batch({"token_versions": versions})), float(np.mean(live))

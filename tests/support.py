"""Helpers shared by the tests (importable as `support`: tests/ is on sys.path via conftest)."""

import contextlib

import jax

from configs import ppo_arith
from hfjax.parallel.mesh import ResourcePool


def tiny_rl_config(*, algorithm="ppo", placement="colocate", mesh=None, out_dir=None,
                   hidden=32):
    """The default config shrunk for tests: a one-layer model, 16-prompt batches, 8-token
    responses, no warm start, rewards scored in this process (where tests register theirs).

    `placement` is a mode or a mapping; `mesh` sets the actor's, critic's and reference's.
    """
    c = ppo_arith.get_config()
    c.algorithm = algorithm
    c.placement = placement
    m = c.model
    m.hidden_size, m.intermediate_size, m.head_dim = hidden, 64, 16
    m.num_layers, m.num_heads, m.num_kv_heads = 1, 2, 1
    c.data.n_train, c.data.n_test, c.data.train_batch_size = 64, 16, 16
    c.sft.steps = 0
    c.rollout.n = 1
    c.rollout.response_length = 8
    for role in (c.actor, c.critic, c.cost_critic):
        role.ppo_mini_batch_size = 8  # prompts (times rollout.n sequences)
        role.ppo_micro_batch_size = 8  # sequences: a multiple of the largest dp size, 8
    if mesh is not None:
        for role in (c.actor, c.critic, c.cost_critic, c.ref):
            role.mesh = mesh
    if out_dir is not None:
        c.trainer.out_dir = str(out_dir)
    c.trainer.sync_stage_timing = True
    c.reward.num_processes = 0
    return c


def pool_mesh(lo, hi, spec):
    """A mesh over devices lo..hi-1, e.g. pool_mesh(4, 8, "data=2,tensor=2")."""
    return ResourcePool(f"devices{lo}-{hi}", tuple(jax.devices()[lo:hi])).mesh(spec)


@contextlib.contextmanager
def no_host_round_trip():
    """Forbids every host<->device copy, explicit or not.

    On CPU, reading a device buffer from the host is zero-copy and the device-to-host guard does
    not fire, so the host-to-device guard is what catches a round trip (its re-upload).
    """
    with (
        jax.transfer_guard_device_to_host("disallow_explicit"),
        jax.transfer_guard_host_to_device("disallow_explicit"),
    ):
        yield

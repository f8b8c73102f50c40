"""One process of the multi-process tests (run by test_distributed.py, not collected by pytest).

    --job=matmul  a jitted matmul on a mesh over every process's devices, inputs built from
                  per-process data and per-device callbacks; writes the gathered result to --out
    --job=loop    prints "ready", then runs small collectives until killed (or, on process
                  --fail_on, raises an error)
    --job=mesh    checks --mesh against the devices of all processes
"""

import sys
import time

import numpy as np
from absl import app, flags

from hfjax.parallel import distributed

distributed.define_flags()
_JOB = flags.DEFINE_enum("job", "matmul", ["matmul", "loop", "mesh"], "what to run")
_OUT = flags.DEFINE_string("out", None, "matmul: .npz file for process 0's gathered results")
_MESH = flags.DEFINE_string("mesh", "fsdp=2,tensor=4", "mesh over all devices")
_FAIL_ON = flags.DEFINE_integer("fail_on", -1, "loop: this process raises once it is ready")

ROWS, INNER, COLS = 64, 96, 40


def inputs():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((ROWS, INNER), dtype=np.float32)
    w = rng.standard_normal((INNER, COLS), dtype=np.float32)
    return x, w


def matmul(topo):
    import jax
    import jax.numpy as jnp
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from hfjax.parallel.mesh import MeshSpec, sorted_devices

    mesh = MeshSpec.parse(_MESH.value).build(sorted_devices())
    x, w = inputs()
    rows = NamedSharding(mesh, P("fsdp", None))
    # Each process holds the rows of the devices it hosts: with devices in process order and
    # fsdp outermost over tensor, that is one contiguous block of rows per process.
    per = ROWS // topo.num_processes
    mine = x[topo.process_id * per:(topo.process_id + 1) * per]
    x_global = jax.make_array_from_process_local_data(rows, mine, (ROWS, INNER))
    assert x_global.shape == (ROWS, INNER)
    for shard in x_global.addressable_shards:  # what this process fed is what it holds
        np.testing.assert_array_equal(np.asarray(shard.data), x[shard.index])
    # The trainer's way: every process holds the whole (small) host batch and device_put
    # uploads its own devices' shards. It must give the same global array.
    x_put = jax.device_put(x, rows)
    assert x_put.sharding == x_global.sharding
    for a, b in zip(x_put.addressable_shards, x_global.addressable_shards):
        assert a.device == b.device and a.index == b.index
        np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))
    same = jax.jit(lambda a, b: jnp.all(a == b), out_shardings=NamedSharding(mesh, P()))
    assert bool(same(x_put, x_global))
    w_global = jax.make_array_from_callback(
        (INNER, COLS), NamedSharding(mesh, P(None, "tensor")), lambda idx: w[idx])
    out_sharding = NamedSharding(mesh, P("fsdp", "tensor"))
    y = jax.jit(lambda a, b: a @ b, out_shardings=out_sharding)(x_global, w_global)
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(y)
    back = multihost_utils.process_allgather(x_global, tiled=True)
    y_all = multihost_utils.process_allgather(y, tiled=True)
    np.testing.assert_array_equal(back, x)  # the round trip through the global array
    print(f"process {topo.process_id}: {topo.describe()}, sum {float(total):.6f}", flush=True)
    if topo.process_id == 0 and _OUT.value:
        np.savez(_OUT.value, y=y_all, total=np.asarray(total), x=back)


def loop(topo):
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from hfjax.parallel.mesh import MeshSpec, sorted_devices

    mesh = MeshSpec.parse(f"data={topo.total_devices}").build(sorted_devices())
    ones = np.ones(topo.local_devices, np.float32)
    a = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), ones)
    f = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))
    f(a).block_until_ready()
    print(f"process {topo.process_id}: ready", flush=True)
    if topo.process_id == _FAIL_ON.value:
        raise RuntimeError("a deliberate failure on this process")
    while True:
        f(a).block_until_ready()
        time.sleep(0.05)


def main(argv):
    del argv
    try:
        topo = distributed.initialize_from_flags()
        if _JOB.value == "mesh":
            distributed.check_mesh_fits(_MESH.value, "--mesh")
    except distributed.DistributedError as err:
        sys.exit(f"hfjax: {err}")
    {"matmul": matmul, "loop": loop, "mesh": lambda t: print("mesh fits")}[_JOB.value](topo)


if __name__ == "__main__":
    app.run(main)

"""MeshSpec parsing and resolution, pool carving, and data-parallel axis helpers."""

import collections

import jax
import pytest
from jax.sharding import AxisType

from hfjax.parallel.mesh import (
    MESH_AXES,
    MeshSpec,
    ResourcePool,
    batch_sharding,
    batch_spec,
    carve_pools,
    dp_axes,
    dp_size,
    sorted_devices,
)

FakeDevice = collections.namedtuple("FakeDevice", ["id", "process_index"])


def test_parse_fills_absent_axes_in_canonical_order():
    spec = MeshSpec.parse(" tensor=2 , data=2,fsdp=2")
    assert spec.sizes == (("data", 2), ("fsdp", 2), ("expert", 1), ("sequence", 1),
                          ("tensor", 2))
    assert MeshSpec.parse("tensor=2").sizes == (
        ("data", 1),
        ("fsdp", 1),
        ("expert", 1),
        ("sequence", 1),
        ("tensor", 2),
    )
    assert MeshSpec.parse(spec) is spec


@pytest.mark.parametrize(
    "text, n, expected",
    [
        ("data=2,fsdp=2,tensor=2", 8,
         {"data": 2, "fsdp": 2, "expert": 1, "sequence": 1, "tensor": 2}),
        ("fsdp=-1,tensor=2", 8, {"data": 1, "fsdp": 4, "expert": 1, "sequence": 1, "tensor": 2}),
        ("fsdp=-1,tensor=2", 4, {"data": 1, "fsdp": 2, "expert": 1, "sequence": 1, "tensor": 2}),
        ("tensor=2", 2, {"data": 1, "fsdp": 1, "expert": 1, "sequence": 1, "tensor": 2}),
        ("data=-1", 3, {"data": 3, "fsdp": 1, "expert": 1, "sequence": 1, "tensor": 1}),
        ("sequence=2,fsdp=2", 4, {"data": 1, "fsdp": 2, "expert": 1, "sequence": 2, "tensor": 1}),
    ],
)
def test_resolve(text, n, expected):
    assert MeshSpec.parse(text).resolve(n) == expected


@pytest.mark.parametrize(
    "text, match",
    [
        ("", "empty mesh spec"),
        ("fsdp4", r"cannot parse 'fsdp4'.*'axis=size'"),
        ("fsdp=4,,tensor=2", r"cannot parse ''"),
        ("fsdp=two", r"cannot parse 'fsdp=two'"),
        ("pipeline=2",
         r"unknown axis 'pipeline'; valid axes are data, fsdp, expert, sequence, tensor"),
        ("fsdp=2,fsdp=2", r"axis 'fsdp' is given twice"),
        ("fsdp=0", r"axis 'fsdp' has size 0; sizes must be positive"),
        ("tensor=-2", r"axis 'tensor' has size -2"),
        ("fsdp=-1,data=-1", r"axes fsdp, data are all -1; at most one axis may be -1"),
    ],
)
def test_parse_errors(text, match):
    with pytest.raises(ValueError, match=match):
        MeshSpec.parse(text)


def test_resolve_errors_name_mesh_and_pool():
    with pytest.raises(
        ValueError, match=r"mesh 'fsdp=3,tensor=2' needs 6 devices, pool 'actor' has 8"
    ):
        MeshSpec.parse("fsdp=3,tensor=2").resolve(8, pool="actor")
    with pytest.raises(
        ValueError,
        match=r"mesh 'fsdp=-1,tensor=3': the fixed axes need a multiple of 3 devices, "
        r"pool 'actor' has 8",
    ):
        MeshSpec.parse("fsdp=-1,tensor=3").resolve(8, pool="actor")


def test_build_mesh_has_all_axes_auto_and_tensor_fastest():
    devices = jax.devices()
    mesh = MeshSpec.parse("fsdp=-1,tensor=2").build(devices)
    assert mesh.axis_names == MESH_AXES
    assert dict(mesh.shape) == {"data": 1, "fsdp": 4, "expert": 1, "sequence": 1, "tensor": 2}
    assert all(t == AxisType.Auto for t in mesh.axis_types)
    # tensor groups are consecutive devices.
    grid = mesh.devices.reshape(4, 2)
    assert [[d.id for d in row] for row in grid] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_pool_mesh_uses_pool_devices_and_names_pool_in_errors():
    pool = ResourcePool("rollout", tuple(jax.devices()[4:]))
    mesh = pool.mesh("tensor=2,data=-1")
    assert {d.id for d in mesh.devices.flat} == {4, 5, 6, 7}
    assert dict(mesh.shape)["data"] == 2
    with pytest.raises(ValueError, match=r"needs 8 devices, pool 'rollout' has 4"):
        pool.mesh("fsdp=8")


def test_pool_rejects_empty_and_duplicate_devices():
    with pytest.raises(ValueError, match="pool 'x' has no devices"):
        ResourcePool("x", ())
    d = jax.devices()[0]
    with pytest.raises(ValueError, match="lists a device twice"):
        ResourcePool("x", (d, d))


def test_carve_pools_consecutive_and_disjoint():
    pools = carve_pools({"actor": 4, "critic": 2, "reward": 2})
    assert list(pools) == ["actor", "critic", "reward"]
    assert pools["actor"].device_ids == (0, 1, 2, 3)
    assert pools["critic"].device_ids == (4, 5)
    assert pools["reward"].device_ids == (6, 7)
    assert pools["actor"].size == 4


def test_carve_pools_sorts_devices_and_places_larger_pools_first():
    # Shuffled input is put back in topology order; the big pool gets the first whole block.
    devices = list(reversed(jax.devices()))
    pools = carve_pools({"small": 2, "big": 4}, devices)
    assert list(pools) == ["small", "big"]
    assert pools["big"].device_ids == (0, 1, 2, 3)
    assert pools["small"].device_ids == (4, 5)


def test_carve_pools_keeps_hosts_whole():
    # Two hosts of 4 devices, ids interleaved across hosts.
    devices = [FakeDevice(id=i, process_index=i % 2) for i in range(8)]
    assert [d.id for d in sorted_devices(devices)] == [0, 2, 4, 6, 1, 3, 5, 7]
    pools = carve_pools({"ref": 2, "actor": 4, "critic": 2}, devices)
    assert {d.process_index for d in pools["actor"].devices} == {0}
    assert pools["actor"].device_ids == (0, 2, 4, 6)
    assert pools["ref"].device_ids == (1, 3)
    assert pools["critic"].device_ids == (5, 7)


def test_carve_pools_errors():
    with pytest.raises(
        ValueError, match=r"pools \(actor=6, critic=4\) need 10 devices, only 8 are available"
    ):
        carve_pools({"actor": 6, "critic": 4})
    with pytest.raises(ValueError, match="pool 'actor' has size 0"):
        carve_pools({"actor": 0})


def test_dp_axes_and_size():
    devices = jax.devices()
    mesh = MeshSpec.parse("data=2,fsdp=2,tensor=2").build(devices)
    assert dp_axes(mesh) == ("data", "fsdp")
    assert dp_size(mesh) == 4
    assert batch_spec(mesh) == jax.sharding.PartitionSpec(("data", "fsdp"))
    mesh = MeshSpec.parse("fsdp=-1,tensor=2").build(devices)
    assert dp_axes(mesh) == ("fsdp",)
    assert dp_size(mesh) == 4
    assert batch_sharding(mesh).spec == jax.sharding.PartitionSpec("fsdp")
    mesh = MeshSpec.parse("tensor=8").build(devices)
    assert dp_axes(mesh) == ()
    assert dp_size(mesh) == 1
    assert batch_spec(mesh) == jax.sharding.PartitionSpec()

"""What a collective of a compiled program moves, read from its optimized HLO by role
(`hfjax.parallel.hlo.operand_roles`): an FSDP weight whose dimension equals a row's length is a
weight, a gradient reduced over the sequence devices is a gradient, and only rows of
activations gathered across `sequence` are activations crossing that axis."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hfjax.parallel import hlo

T = 16  # a row's length, and the weight's first dimension


def _step_hlo(gather_rows: bool, donate: bool = True) -> str:
    """One SGD step of a one-matmul model on a tensor=2 x sequence=4 mesh: rows [2, T, T] split
    over `sequence`, the weight [T, 24] split over it too (FSDP over the sequence devices);
    `gather_rows` gathers the layer's output to whole rows before the loss."""
    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(2, 4), ("tensor", "sequence"))
    ws = NamedSharding(mesh, P("sequence", None))

    def step(params, x):
        def loss(params):
            y = jnp.tanh(x @ params["w"])
            if gather_rows:
                y = jax.lax.with_sharding_constraint(y, NamedSharding(mesh, P()))
            return jnp.sum(y ** 2)

        value, grad = jax.value_and_grad(loss)(params)
        return value, jax.tree.map(lambda p, g: p - 0.1 * g, params, grad)

    params = {"w": jax.ShapeDtypeStruct((T, 24), jnp.float32, sharding=ws)}
    x = jax.ShapeDtypeStruct((2, T, T), jnp.float32,
                             sharding=NamedSharding(mesh, P(None, "sequence", None)))
    fn = jax.jit(step, out_shardings=(None, {"w": ws}), donate_argnums=0 if donate else ())
    return fn.lower(params, x).compile().as_text()


def _roles(text):
    """{role: [result dims]} of the operands of the collectives that cross `sequence`."""
    out = {}
    for c, i, role in hlo.operand_roles(text):
        if hlo.spans(c.line, (2, 4), 1):
            out.setdefault(role, []).append(c.shapes[i][1])
    return out


@pytest.fixture(scope="module")
def texts():
    return {rows: _step_hlo(rows) for rows in (False, True)}


def test_fsdp_weight_and_its_gradient_are_not_taken_for_rows(texts):
    roles = _roles(texts[False])
    # Both hold T in their shape: a shape rule would call them row gathers.
    assert (T, 24) in roles["weights"]
    assert any(T in dims for dims in roles["gradients"])
    assert not any(T in dims for dims in roles["activations"])  # the loss's sum only


def test_rows_gathered_across_sequence_are_activations(texts):
    roles = _roles(texts[True])
    assert (2, T, 24) in roles["activations"]
    assert (T, 24) in roles["weights"]


def test_a_result_that_replaces_no_input_is_no_gradient():
    roles = _roles(_step_hlo(False, donate=False))
    assert "gradients" not in roles
    assert any(T in dims for dims in roles["activations"])


def test_replica_groups_and_the_axes_they_cross():
    line = ("%ar = f32[4] all-reduce(%x), replica_groups=mesh['axis_0'=2,'axis_1'=1,'axis_2'=8],"
            " device_ids=([8,2]T(1,0)) {'axis_0'}, to_apply=%add")
    assert hlo.replica_groups(line) == [[2 * i, 2 * i + 1] for i in range(8)]
    # A sequence=8 x tensor=2 mesh: pairs of neighbours differ in `tensor` only.
    assert hlo.spans(line, (8, 2), 1) and not hlo.spans(line, (8, 2), 0)
    iota = "%ag = f32[8] all-gather(%x), replica_groups=[2,8]<=[8,2]T(1,0), dimensions={0}"
    assert hlo.replica_groups(iota) == [[0, 2, 4, 6, 8, 10, 12, 14],
                                        [1, 3, 5, 7, 9, 11, 13, 15]]
    assert hlo.spans(iota, (8, 2), 0) and not hlo.spans(iota, (8, 2), 1)
    assert hlo.replica_groups("%p = f32[2] collective-permute(%x), "
                              "source_target_pairs={{0,1},{1,0}}") == [[0, 1], [1, 0]]

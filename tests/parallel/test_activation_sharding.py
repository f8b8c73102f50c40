"""Logical activation constraints: `sharding.constrain` under a worker group's layout."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hfjax.models import transformer
from hfjax.models.presets import get_preset
from hfjax.parallel import sharding as shd
from hfjax.parallel.mesh import ResourcePool
from hfjax.workers.base import WorkerGroup


def test_constrain_is_identity_without_a_layout():
    x = jnp.ones((4, 8))
    assert shd.constrain(x, ("batch", "embed")) is x


def test_constrain_maps_logical_axes_and_batch_onto_the_active_mesh():
    mesh = ResourcePool("all", tuple(jax.devices())).mesh("fsdp=4,tensor=2")
    layout = shd.layout(mesh, "train")

    def f(x):
        with shd.activation_layout(layout):
            return shd.constrain(x, ("batch", "vocab")) * 2

    y = jax.jit(f)(jnp.ones((8, 6)))
    assert y.sharding.spec == P("fsdp", "tensor")
    np.testing.assert_array_equal(np.asarray(y), 2.0)


def test_gathered_keeps_only_a_weights_tensor_split():
    """The nested rules store the embedding table split over vocab on tensor x fsdp x sequence;
    in use (`gathered`) it is whole over fsdp and sequence and split over tensor only."""
    mesh = ResourcePool("all", tuple(jax.devices())).mesh("fsdp=2,sequence=2,tensor=2")
    layout = shd.layout(mesh, "nested_train")
    axes = ("vocab", "embed")
    w = jax.device_put(jnp.arange(16.0 * 6).reshape(16, 6), layout.sharding(axes, (16, 6)))
    assert w.sharding.spec == P(("tensor", "fsdp", "sequence"))

    def f(w):
        with shd.activation_layout(layout):
            return shd.gathered(w, axes) * 2

    y = jax.jit(f)(w)
    assert y.sharding.spec == P("tensor")
    np.testing.assert_array_equal(np.asarray(y), 2 * np.asarray(w))
    assert shd.gathered(w, axes) is w  # no layout active: x itself


def _grad_hlo(jit, group: WorkerGroup, ids, mask) -> str:
    """Optimised HLO of the gradient of a mean logit, compiled by `jit`."""

    def loss(params, ids, mask):
        return jnp.mean(group.model(params)(ids, mask))

    return jit(jax.grad(loss)).lower(group.params, ids, mask).compile().as_text()


def test_embedding_lookup_and_gradient_move_no_token_ids_between_devices():
    """Under fsdp x tensor training rules, the lookup's gradient (a scatter-add) otherwise
    reorders the token ids with an 8-way collective-permute; XLA:CPU can run that and the
    parameter all-gathers in different orders on different devices and deadlock."""
    pool = ResourcePool("all", tuple(jax.devices()))
    group = WorkerGroup("actor", pool, "fsdp=4,tensor=2", transformer.build(get_preset("tiny")))
    rows = NamedSharding(group.mesh, P("fsdp"))
    ids = jax.device_put(jnp.zeros((8, 12), jnp.int32), rows)
    mask = jax.device_put(jnp.ones((8, 12), jnp.int32), rows)
    plain = _grad_hlo(jax.jit, group, ids, mask)
    constrained = _grad_hlo(group.jit, group, ids, mask)
    assert "collective-permute" in plain  # the failure this guards against is real
    assert "collective-permute" not in constrained


def test_token_selection_runs_on_whole_rows_of_vocab_split_logits():
    """Tensor-parallel logits arrive split over the vocabulary; sampling reverses and slices
    them, which XLA otherwise does with collective-permutes between the tensor pairs."""
    from hfjax.engine.token_select import Knobs, Static, select_tokens

    mesh = ResourcePool("all", tuple(jax.devices())).mesh("data=4,tensor=2")
    layout = shd.layout(mesh, "decode")
    static = Static(batch=8, prompt_bucket=16, new_bucket=16, n=1, greedy=False, top_k=0,
                    use_top_p=True, use_min_p=False, num_stops=0)
    knobs = Knobs(*(jnp.float32(v) for v in (1.0, 0.9, 0.0)), jnp.int32(4), jnp.int32(0))

    def select(logits, keys):
        return select_tokens(logits, keys, static, knobs)

    logits = jax.device_put(jax.random.normal(jax.random.key(0), (8, 64)),
                            NamedSharding(mesh, P("data", "tensor")))
    keys = jax.random.split(jax.random.key(1), 8)
    plain = jax.jit(select).lower(logits, keys).compile().as_text()
    under = jax.jit(shd.under_layout(layout, select))
    assert "collective-permute" in plain
    assert "collective-permute" not in under.lower(logits, keys).compile().as_text()
    tok_plain, lp_plain = jax.jit(select)(logits, keys)
    tok, lp = under(logits, keys)
    np.testing.assert_array_equal(np.asarray(tok), np.asarray(tok_plain))
    np.testing.assert_allclose(np.asarray(lp), np.asarray(lp_plain), rtol=1e-6)

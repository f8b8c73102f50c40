"""LoRA adapter dropout: the mask's statistics and scaling, where it enters a projection
(checked in NumPy against the mask it drew), that only a training context applies it, and an
update step on 8 devices whose gradients are those of its micro-batches under the documented
keys."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hfjax.engine.update import make_optimizer, strided_micro_batches
from hfjax.models import lora, lora_dropout, transformer
from hfjax.models.config import ModelConfig
from hfjax.parallel.mesh import ResourcePool
from hfjax.workers.base import WorkerGroup

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8)


def _ids(rows=4, cols=7, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, 64, (rows, cols)), jnp.int32)


def _adapted(rate: float, b_scale: float = 0.1, cfg: ModelConfig = CFG):
    """A model with adapters of dropout `rate` on every projection, B random (non-zero)."""
    model = transformer.build(cfg, seed=0)
    lora.add_adapters(model, lora.LoraSpec(rank=4, alpha=8.0, dropout=rate), seed=1)
    rng = np.random.default_rng(1)
    layers = model.model.layers
    for name in list(vars(layers)):
        if name.endswith("_lora_b"):
            var = getattr(layers, name)
            var.set_value(jnp.asarray(b_scale * rng.standard_normal(var.get_value().shape),
                                      jnp.float32))
    return model


def test_the_mask_drops_a_fraction_rate_and_scales_the_rest():
    x = jnp.ones((512, 512), jnp.float32)
    key = jax.random.key(3)
    y = np.asarray(lora_dropout.apply(x, key, 0.25))
    dropped = (y == 0).mean()
    assert abs(dropped - 0.25) < 0.01, dropped
    np.testing.assert_array_equal(y[y != 0], np.float32(1 / 0.75))
    np.testing.assert_array_equal(np.asarray(lora_dropout.apply(x, key, 0.25)), y)
    other = np.asarray(lora_dropout.apply(x, jax.random.key(4), 0.25))
    assert (other != y).mean() > 0.3
    assert lora_dropout.apply(x.astype(jnp.bfloat16), key, 0.25).dtype == jnp.bfloat16
    with pytest.raises(ValueError, match=r"lora.dropout=1.0.*\(0, 1\)"):
        lora_dropout.Dropout(1.0, 0)
    with pytest.raises(ValueError, match=r"lora.dropout=1.0; it must be in \[0, 1\)"):
        lora.LoraSpec(rank=2, alpha=2.0, dropout=1.0)


def test_a_projection_drops_the_adapters_input_only():
    """x @ W + (mask * x / (1 - p)) @ A @ B, with the mask read back from a probe (x = 1,
    A = B = I): the base product sees x whole, and each projection draws its own mask."""
    rate, T, d = 0.5, 6, 8
    cfg = ModelConfig(**{**CFG.__dict__, "hidden_size": d})
    rng = np.random.default_rng(0)
    key = jax.random.key(5)

    def proj(name, x, w, a, b, dropout=True):
        p = {name: w, f"{name}_lora_a": a, f"{name}_lora_b": b}
        if not dropout:
            return np.asarray(transformer._proj(cfg, p, x, name, (d,)))
        p[lora_dropout.LAYER_KEY] = key
        with lora_dropout.training(key, rate):
            return np.asarray(transformer._proj(cfg, p, x, name, (d,)))

    eye = jnp.eye(d, dtype=jnp.float32)
    ones = jnp.ones((1, T, d), jnp.float32)
    masks = {n: proj(n, ones, jnp.zeros((d, d)), eye, eye)[0] * (1 - rate)
             for n in ("q_proj", "up_proj")}
    for m in masks.values():
        assert set(np.unique(m)) == {0.0, 1.0}
    assert not np.array_equal(masks["q_proj"], masks["up_proj"])

    x = rng.standard_normal((1, T, d)).astype(np.float32)
    w, a, b = (rng.standard_normal(s).astype(np.float32) for s in ((d, d), (d, 4), (4, d)))
    got = proj("up_proj", jnp.asarray(x), jnp.asarray(w), jnp.asarray(a), jnp.asarray(b))
    x64, w64, a64, b64 = (v.astype(np.float64) for v in (x[0], w, a, b))
    want = x64 @ w64 + ((masks["up_proj"] * x64 / (1 - rate)) @ a64) @ b64
    np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-5)
    plain = proj("up_proj", jnp.asarray(x), jnp.asarray(w), jnp.asarray(a), jnp.asarray(b),
                 dropout=False)
    np.testing.assert_allclose(plain[0], x64 @ w64 + (x64 @ a64) @ b64, rtol=1e-5, atol=1e-5)


def test_only_a_training_context_applies_dropout():
    ids = _ids()
    model, same = _adapted(0.5), _adapted(0.0)
    graphdef, state = nnx.split(model)
    # Outside a training step (scoring, the reference, decoding) the rate changes nothing.
    np.testing.assert_array_equal(np.asarray(model(ids)), np.asarray(same(ids)))

    @jax.jit
    def train_forward(state, key):
        with lora_dropout.training(key, 0.5):
            return nnx.merge(graphdef, state)(ids)

    k1, k2 = jax.random.key(1), jax.random.key(2)
    a, again, b = (np.asarray(train_forward(state, k)) for k in (k1, k1, k2))
    np.testing.assert_array_equal(a, again)
    assert np.abs(a - np.asarray(model(ids))).max() > 1e-3
    assert np.abs(a - b).max() > 1e-3
    # With B = 0 the adapters add nothing, dropped or not: the base path is never dropped.
    zero = _adapted(0.5, b_scale=0.0)
    zgd, zstate = nnx.split(zero)
    with lora_dropout.training(k1, 0.5):
        dropped = np.asarray(nnx.merge(zgd, zstate)(ids))
    np.testing.assert_array_equal(dropped, np.asarray(zero(ids)))


def _group(rate):
    return WorkerGroup("actor", ResourcePool("actor", jax.devices()), "fsdp=4,tensor=2",
                       _adapted(rate), optimizer=make_optimizer(1e-2))


def _host(tree):
    with jax.transfer_guard("allow"):
        return {jax.tree_util.keystr(k): np.array(v)
                for k, v in jax.tree_util.tree_leaves_with_path(tree)}


def test_an_update_step_draws_its_micro_batches_masks_from_the_step_key():
    """On 8 devices, two micro-batches: the step's loss and gradient norm are those of its
    strided micro-batches, each under step_key(seed, counter) with its index folded in; the
    same counter repeats the step bit for bit, and the update differs from one without
    dropout."""
    ids = _ids(8, 6)

    def run(rate, counter):
        g = _group(rate)
        before = _host(g.trainable_params())

        def loss(params, mb, totals):
            return jnp.mean(g.model(params)(mb["ids"]) ** 2) / 2, {}

        step = g.update_program(loss, 2, normalisers=None)
        extra = () if g.dropout is None else (g.dropout_counter(*counter),)
        x = jax.device_put(ids, g.layout.replicated())
        g.params, g.opt_state, m = step(g.params, g.opt_state, {"ids": x}, *extra)
        with jax.transfer_guard("allow"):
            metrics = {k: float(v) for k, v in m.items()}
        return g, loss, before, _host(g.trainable_params()), metrics

    g, loss, before, after, m = run(0.5, (3, 1))
    assert g.dropout == lora_dropout.Dropout(0.5, 1)
    _, _, _, again, m_again = run(0.5, (3, 1))
    _, _, _, other, m_other = run(0.5, (3, 2))
    _, _, _, plain, m_plain = run(0.0, (3, 1))
    assert m_again == m
    for k in after:
        np.testing.assert_array_equal(again[k], after[k], err_msg=k)
    assert m_other["loss"] != m["loss"] and m_plain["loss"] != m["loss"]
    assert any(not np.array_equal(after[k], plain[k]) for k in after)

    # The independent computation: per micro-batch, the loss and its gradient under that
    # micro-batch's key, summed.
    model = _adapted(0.5)
    graphdef, state = nnx.split(model)
    train, frozen = nnx.split_state(state, nnx.LoRAParam, ...)
    micro = np.asarray(strided_micro_batches(ids, 2))
    step_key = lora_dropout.step_key(1, jnp.asarray([3, 1], jnp.uint32))
    total, grads = 0.0, None
    for i in range(2):
        def f(t, i=i):
            with lora_dropout.training(jax.random.fold_in(step_key, jnp.uint32(i)), 0.5):
                return jnp.mean(nnx.merge(graphdef, nnx.merge_state(t, frozen))(
                    jnp.asarray(micro[i])) ** 2) / 2
        value, g_i = jax.value_and_grad(f)(train)
        total += float(value)
        grads = g_i if grads is None else jax.tree.map(jnp.add, grads, g_i)
    norm = float(jnp.sqrt(sum(jnp.sum(x ** 2) for x in jax.tree.leaves(grads))))
    np.testing.assert_allclose(m["loss"], total, rtol=1e-5)
    np.testing.assert_allclose(m["grad_norm"], norm, rtol=1e-4)
    assert m["grad_norm"] != pytest.approx(m_plain["grad_norm"], rel=1e-3)
    assert before.keys() == after.keys()


def test_remat_and_unrolled_layers_draw_the_same_masks():
    """A rematerialised layer redraws, in the backward pass, the masks its forward drew; an
    unrolled stack draws the scanned stack's: loss and gradients agree across the four."""
    ids = _ids()
    results = []
    for policy, scan in (("none", True), ("full", True), ("none", False), ("dots", False)):
        model = _adapted(0.3, cfg=dataclasses.replace(CFG, remat_policy=policy,
                                                      scan_layers=scan))
        graphdef, state = nnx.split(model)
        train, frozen = nnx.split_state(state, nnx.LoRAParam, ...)

        @jax.jit
        def value_and_grad(t, graphdef=graphdef, frozen=frozen):
            def loss(t):
                with lora_dropout.training(jax.random.key(0), 0.3):
                    return jnp.mean(nnx.merge(graphdef, nnx.merge_state(t, frozen))(ids) ** 2)
            return jax.value_and_grad(loss)(t)

        results.append(jax.tree.map(np.asarray, value_and_grad(train)))
    value, grads = results[0]
    plain = _adapted(0.0)
    assert value != np.mean(np.asarray(plain(ids)) ** 2)
    for v, g in results[1:]:
        np.testing.assert_allclose(v, value, rtol=1e-6)
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(grads)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)

"""LoRA adapters: target names, the adapted forward against merged weights computed in NumPy,
the merged decode copy, and an update step that trains the adapters only."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hfjax.engine.update import make_optimizer
from hfjax.models import lora, transformer
from hfjax.models.config import ModelConfig
from hfjax.parallel.mesh import ResourcePool
from hfjax.workers.base import WorkerGroup

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8)


def _ids(rows=4, cols=7, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, 64, (rows, cols)), jnp.int32)


def _randomise_b(model, seed=1):
    """Non-zero B adapters (they start at zero), so that the adapters change the output."""
    layers = model.model.layers
    rng = np.random.default_rng(seed)
    for name in list(vars(layers)):
        if name.endswith("_lora_b"):
            var = getattr(layers, name)
            var.set_value(jnp.asarray(0.1 * rng.standard_normal(var.get_value().shape),
                                      jnp.float32))


def test_targets_parse_and_unknown_names_are_refused():
    assert lora.parse_targets("all-linear") == lora.TARGETS
    assert lora.parse_targets("v_proj, q_proj") == ("q_proj", "v_proj")
    assert lora.parse_targets(["down_proj"]) == ("down_proj",)
    with pytest.raises(ValueError, match="unknown projection 'wq'.*q_proj"):
        lora.parse_targets("q_proj,wq")
    with pytest.raises(ValueError, match="twice"):
        lora.parse_targets("q_proj,q_proj")
    with pytest.raises(ValueError, match="rank=0"):
        lora.LoraSpec(rank=0, alpha=1.0)


def test_adapters_start_as_the_base_and_are_float32_over_a_bf16_base():
    cfg = ModelConfig(**{**CFG.__dict__, "param_dtype": "bfloat16"})
    model = transformer.build(cfg, seed=0)
    ids = _ids()
    base = np.asarray(model(ids))
    lora.add_adapters(model, lora.LoraSpec(rank=4, alpha=8.0, targets=("q_proj", "down_proj")))
    np.testing.assert_array_equal(np.asarray(model(ids)), base)  # B = 0
    state = nnx.state(model)
    adapters = jax.tree.leaves(lora.adapter_state(state))
    assert len(adapters) == 4 and all(a.dtype == jnp.float32 for a in adapters)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(lora.base_state(state)))
    assert lora.adapter_bytes(cfg, lora.LoraSpec(4, 8.0, ("q_proj", "down_proj"))) == 4 * 2 * (
        32 * 4 + 4 * 4 * 8 + 48 * 4 + 4 * 32)


def test_adapted_forward_equals_the_base_with_merged_weights():
    model = transformer.build(CFG, seed=0)
    spec = lora.LoraSpec(rank=3, alpha=6.0)
    lora.add_adapters(model, spec, seed=2)
    _randomise_b(model)
    ids = _ids()
    got = np.asarray(model(ids))

    # The reference: W + (alpha / rank) * A @ B per layer, in NumPy, loaded into a plain model.
    plain = transformer.build(CFG, seed=0)
    layers = model.model.layers
    for name in lora.TARGETS:
        w = np.asarray(getattr(layers, name).get_value(), np.float64)
        a = np.asarray(getattr(layers, f"{name}_lora_a").get_value(), np.float64)
        b = np.asarray(getattr(layers, f"{name}_lora_b").get_value(), np.float64)
        merged = np.empty_like(w)
        for i in range(CFG.num_layers):
            ai = a[i].reshape(-1, spec.rank)
            bi = b[i].reshape(spec.rank, -1)
            wi = w[i].reshape(ai.shape[0], bi.shape[1])
            merged[i] = (wi + 2.0 * ai @ bi).reshape(w.shape[1:])
        getattr(plain.model.layers, name).set_value(jnp.asarray(merged, jnp.float32))
    want = np.asarray(plain(ids))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)

    # The merged decode copy is that same base model.
    graphdef, state = nnx.split(model)
    base_gd = lora.base_graphdef(model)
    merged_state = jax.jit(lambda s: lora.merged_state(graphdef, base_gd, s))(state)
    np.testing.assert_allclose(np.asarray(nnx.merge(base_gd, merged_state)(ids)), want,
                               rtol=1e-4, atol=1e-4)


def test_an_update_trains_the_adapters_only_on_eight_devices():
    cfg = ModelConfig(**{**CFG.__dict__, "param_dtype": "bfloat16"})
    model = transformer.build(cfg, seed=0)
    lora.add_adapters(model, lora.LoraSpec(rank=4, alpha=8.0), seed=1)
    _randomise_b(model)  # so that A gets a gradient too
    group = WorkerGroup("actor", ResourcePool("actor", jax.devices()), "fsdp=4,tensor=2", model,
                        optimizer=make_optimizer(1e-2))
    # Adam's moments exist for the adapters only, in float32.
    moments = [x for x in jax.tree.leaves(group.opt_state) if x.ndim > 0]
    adapter_sizes = sorted(x.size for x in jax.tree.leaves(lora.adapter_state(group.params)))
    assert sorted(x.size for x in moments) == sorted(adapter_sizes * 2)
    assert all(x.dtype == jnp.float32 for x in moments)

    def loss(params, mb, totals):
        return jnp.mean(group.model(params)(mb["ids"]) ** 2), {}

    step = group.update_program(loss, 2, normalisers=None)
    with jax.transfer_guard("allow"):
        before = {jax.tree_util.keystr(k): np.array(v) for k, v in
                  jax.tree_util.tree_leaves_with_path(group.params)}
    ids = jax.device_put(_ids(8, 6), group.layout.replicated())
    group.params, group.opt_state, m = step(group.params, group.opt_state, {"ids": ids})
    assert float(m["nonfinite"]) == 0.0
    changed = {jax.tree_util.keystr(k): not np.array_equal(np.asarray(v), before[
        jax.tree_util.keystr(k)]) for k, v in jax.tree_util.tree_leaves_with_path(group.params)}
    assert changed and all(c == ("_lora_" in k) for k, c in changed.items()), changed

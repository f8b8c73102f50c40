"""Expert parallelism in the compiled programs (hfjax.models.expert_parallel).

Equal numbers cannot show where work runs: a program that gathers every expert on every device
gives the same log-probs. These tests read the optimized HLO of the update (log-probs and
their gradient), the log-prob pass and a decode step on fsdp=2 x expert=4 and check that tokens
cross the `expert` axis by all-to-all, that no collective carries the whole expert stack
(every weight collective holds E / ep experts), and that each device's expert matmuls run on
its own E / ep experts (no array spans all E experts' features) over the rows it received.
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hfjax.models import expert_parallel, transformer
from hfjax.models.config import ModelConfig
from hfjax.parallel import sharding as shd
from hfjax.parallel.hlo import collectives
from hfjax.parallel.mesh import MeshSpec, ResourcePool, batch_sharding
from hfjax.workers.actor import response_logprobs
from hfjax.workers.base import WorkerGroup

# Feature sizes that no token count equals: hidden 48, expert width 40, 8 experts on expert=4
# (2 per device), top-3. All E experts' features side by side would be 8 x 48 = 384 or
# 8 x 40 = 320 wide; a device's own two, 96 or 80.
E, EP, K, D, FE = 8, 4, 3, 48, 40
CFG = ModelConfig(vocab_size=400, hidden_size=D, intermediate_size=72, num_layers=1,
                  num_heads=4, num_kv_heads=4, head_dim=8, model_type="qwen3_moe", qk_norm=True,
                  num_experts=E, num_experts_per_tok=K, moe_intermediate_size=FE,
                  norm_topk_prob=True)
MESH = "fsdp=2,expert=4"
ROWS, T, RESPONSE = 16, 12, 6
_SHAPE = re.compile(r"\b(?:f32|bf16|s32)\[([\d,]+)\]")
_DOT = re.compile(r"= f32\[([\d,]*)\]\S* dot\(")


@pytest.fixture(scope="module")
def actor():
    pool = ResourcePool("all", tuple(jax.devices())[:8])
    return WorkerGroup("actor", pool, MESH, transformer.build(CFG, "causal_lm", seed=1))


def _abstract(group):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        group.params)


def _logprobs(group, params, ids):
    lp, _ = response_logprobs(group.model(params), ids, (ids >= 0).astype(jnp.int32),
                              RESPONSE, 1.0, chunk=0, dp=group.dp_size)
    return jnp.mean(lp)


def _programs(actor) -> dict[str, tuple[str, int]]:
    """{name: (optimized HLO, tokens a device routes)} of the three programs."""
    ids = jax.ShapeDtypeStruct((ROWS, T), jnp.int32, sharding=batch_sharding(actor.mesh))
    params = _abstract(actor)
    local = ROWS * T // actor.dp_size
    update = actor.jit(jax.value_and_grad(lambda p, i: _logprobs(actor, p, i)))
    logprob = actor.jit(lambda p, i: _logprobs(actor, p, i))

    def decode(p, cache, tok, pos, mask):
        model = actor.model(p)
        return model(tok, mask, positions=pos, cache=cache, cache_index=T - 1)

    cache = jax.eval_shape(lambda: transformer.KVCache.zeros(CFG, ROWS, T))
    cache = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=jax.sharding.NamedSharding(
            actor.mesh, jax.sharding.PartitionSpec(None, ("fsdp", "expert")))), cache)
    row = jax.ShapeDtypeStruct((ROWS, 1), jnp.int32, sharding=batch_sharding(actor.mesh))
    mask = jax.ShapeDtypeStruct((ROWS, T), jnp.int32, sharding=batch_sharding(actor.mesh))
    return {
        "update": (update.lower(params, ids).compile().as_text(), local),
        "log-prob": (logprob.lower(params, ids).compile().as_text(), local),
        "decode": (actor.jit(decode).lower(params, cache, row, row, mask).compile().as_text(),
                   ROWS // actor.dp_size),
    }


@pytest.fixture(scope="module")
def programs(actor):
    return _programs(actor)


@pytest.mark.parametrize("name", ["update", "log-prob", "decode"])
def test_tokens_cross_the_expert_axis_by_all_to_all(programs, name):
    text, tokens = programs[name]
    a2a = [c for c in collectives(text) if c.op == "all-to-all"]
    # Out and back (and again in the backward pass of the update), each over `expert` only.
    assert len(a2a) >= (4 if name == "update" else 2), name
    assert all(c.group == EP for c in a2a), [c.line[:200] for c in a2a]
    # The blocks: ep x C rows of the hidden size, C = tokens x k (dropless).
    assert any(dims == (1, tokens * K, D) for c in a2a for _, dims in c.shapes), name


@pytest.mark.parametrize("name", ["update", "log-prob", "decode"])
def test_no_device_gathers_or_multiplies_every_expert(programs, name):
    text, tokens = programs[name]
    for c in collectives(text):
        for _, dims in c.shapes:
            assert not (E in dims and (FE in dims or D * E in dims)), c.line[:200]
    widths = {int(d) for dims in _SHAPE.findall(text) for d in dims.split(",")}
    assert not widths & {E * D, E * FE}, name  # no array spans all experts' features
    assert {E // EP * D, E // EP * FE} <= widths, name  # the local experts' grouped matmuls
    # Every dot of expert width runs on the rows this device received: ep blocks of C.
    expert_dots = [tuple(int(d) for d in dims.split(",")) for dims in _DOT.findall(text)]
    expert_dots = [s for s in expert_dots if len(s) == 2 and FE in s]
    assert expert_dots and all(s == (EP * tokens * K, FE) for s in expert_dots), expert_dots


def test_expert_parallel_logits_equal_one_device():
    model = transformer.build(CFG, seed=1)
    ids = jax.random.randint(jax.random.key(0), (8, 6), 0, CFG.vocab_size)
    want = np.asarray(model(ids))
    mesh = MeshSpec.parse(MESH).build(jax.devices()[:8])
    from hfjax.models import hf_io

    sharded = hf_io.build_sharded(CFG, mesh=mesh, seed=1)
    spec = sharded.model.layers.expert_gate.get_value().sharding.spec
    assert spec[1] == "expert"
    lay = shd.layout(mesh, "train")
    got = np.asarray(jax.jit(shd.under_layout(lay, lambda i: sharded(i)))(ids))
    np.testing.assert_allclose(got, want, atol=2e-5)


def test_an_expert_axis_that_does_not_divide_the_experts_is_refused():
    mesh = MeshSpec.parse("expert=3").build(jax.devices()[:3])
    from hfjax.models import hf_io

    with pytest.raises(ValueError, match=r"do not divide dimension 'expert'=8") as err:
        hf_io.build_sharded(CFG, mesh=mesh)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="expert=3 does not divide num_experts=8"):
        expert_parallel.check(CFG, shd.layout(mesh, "train"))
    assert math.prod(mesh.devices.shape) == 3

"""The planner's closed forms against hand computations, the runs' own layouts and XLA's
compiled figures; shard sizes and hybrid-transition bytes over virtual devices against the
3D-HybridEngine on 8 real devices."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hfjax.engine import hybrid, shared_prompt
from hfjax.models import transformer
from hfjax.models.presets import get_preset
from hfjax.parallel import reshard
from hfjax.parallel import sharding as shd
from hfjax.parallel.mesh import MeshSpec
from hfjax.planner import pricing, virtual
from hfjax.planner.pricing import Call, ClosedFormPrices, MeshLayout, ModelSpec
from hfjax.planner.simulator import Simulator, Workload, cluster_for

# The tiny preset: V=256, D=64, F=128, L=2, N=4, K=2, H=16, tied embeddings, float32.
TINY = get_preset("tiny")


def test_tiny_parameter_count_and_shards_by_hand():
    # embed 256*64; per layer q 64*4*16, k and v 64*2*16, o 4*16*64, gate/up/down 64*128,
    # two norms of 64; final norm 64.
    layer = 4096 + 2048 + 2048 + 4096 + 3 * 8192 + 2 * 64
    total = 256 * 64 + 2 * layer + 64
    assert total == 90432 == TINY.num_params()
    actor = ModelSpec("actor", TINY, "causal_lm", True)
    src = ClosedFormPrices()
    assert src.state(actor, MeshLayout()).params == 4 * total
    # fsdp=2 x tensor=2, train rules: every matrix splits 4 ways (K=2 divides tensor=2); the
    # norms (2 layers x 2 x 64, plus 64) stay whole.
    norms = 2 * 2 * 64 + 64
    state = src.state(actor, MeshLayout(fsdp=2, tensor=2))
    assert state.params == 4 * ((total - norms) // 4 + norms)
    assert state.optimizer == 2 * state.params  # Adam's two moments
    # tensor=4 does not divide K=2: k and v split over fsdp only.
    kv = 2 * 2 * 64 * 2 * 16
    expected = (total - norms - kv) // 8 + kv // 2 + norms
    assert src.state(actor, MeshLayout(fsdp=2, tensor=4)).params == 4 * expected
    frozen = ModelSpec("ref", TINY, "causal_lm", False)
    assert src.state(frozen, MeshLayout(data=8)).optimizer == 0


@pytest.mark.parametrize("mesh,rules", [("fsdp=8", "train"), ("fsdp=2,tensor=4", "train"),
                                        ("data=2,fsdp=2,tensor=2", "nested_train")])
def test_shard_bytes_match_the_runs_own_layout(mesh, rules):
    cfg = TINY.replace(num_kv_heads=4, hidden_size=64, vocab_size=256)
    state = nnx.state(transformer.abstract(cfg))
    spec = MeshSpec.parse(mesh)
    lay = shd.layout(spec.build(jax.devices()), rules)
    leaves = jax.tree.leaves(state)
    real = reshard.max_bytes(reshard.tree_shard_bytes(
        jax.tree.leaves(lay.state_shardings(state)), leaves))
    sizes = spec.resolve(8)
    model = ModelSpec("actor", cfg)
    assert pricing.param_shard_bytes(model, MeshLayout(sizes["data"], sizes["fsdp"],
                                                     sizes["tensor"], rules)) == real


def test_flops_by_hand():
    d, f, n, k, h, v, layers = 64, 128, 4, 2, 16, 256, 2
    w = d * h * (2 * n + 2 * k) + 3 * d * f
    assert pricing.layer_matmul_params(TINY) == w == 12288 + 24576
    rows, seq, scored = 3, 32, 8
    # Per token and layer: 2 FLOPs per weight, plus q.k and p.v over all seq keys.
    layer_flops = rows * seq * layers * (2 * w + 4 * n * h * seq)
    head = 2 * d * v * rows * scored
    assert pricing.forward_flops(TINY, "causal_lm", rows, seq, scored) == layer_flops + head
    assert (pricing.forward_flops(TINY, "value", rows, seq, scored)
            == layer_flops + 2 * d * rows * seq)
    model = ModelSpec("actor", TINY, "causal_lm", True)
    train = ClosedFormPrices().call(model, MeshLayout(data=2), Call("train", 8, seq, scored, 4))
    # Two micro-batches of 4 rows, 2 of them per device; forward + twice that backward.
    assert train.flops == 2 * 3 * pricing.forward_flops(TINY, "causal_lm", 2, seq, scored)
    remat = ModelSpec("actor", TINY.replace(remat_policy="full"), "causal_lm", True)
    train_remat = ClosedFormPrices().call(remat, MeshLayout(data=2),
                                         Call("train", 8, seq, scored, 4))
    assert train_remat.flops == train.flops + 2 * pricing.layers_flops(TINY, 2, seq, seq)
    # One decode step: every row attends over all 48 slots; the LM head on one position.
    step = ClosedFormPrices().call(model, MeshLayout(data=1, tensor=2, rules="decode"),
                                  Call("decode", 6, 48))
    assert step.flops == (6 * layers * (2 * w + 4 * n * h * 48) + 2 * d * v * 6) / 2


def test_memory_terms_by_hand():
    # KV cache: keys and values of K=2 heads of 16 floats per layer, 2 layers.
    assert pricing.kv_bytes_per_token(TINY) == 2 * 2 * 2 * 16 * 4 == 512
    # A bf16 model's cache is bf16 on GPUs and TPUs, float32 on CPU (transformer.storage_dtype).
    bf16 = TINY.replace(dtype="bfloat16")
    assert pricing.kv_bytes_per_token(bf16, "gpu") == pricing.kv_bytes_per_token(bf16, "tpu") == 256
    assert pricing.kv_bytes_per_token(bf16, "cpu") == 512
    decode = Call("decode", 8, 48)
    on = {p: ClosedFormPrices(p).call(ModelSpec("actor", bf16, "causal_lm", False), MeshLayout(),
                                     decode) for p in ("gpu", "cpu")}
    assert on["cpu"].bytes_accessed - on["gpu"].bytes_accessed == 8 * 48 * 256
    assert pricing.kv_split(TINY, 2) == 2 and pricing.kv_split(TINY, 4) == 1
    # a(32) = 4 (4*64 + (2*4 + 3*2)*16 + 4*16 + 4*128) + 8*64 + 4*32*(4 + 4)
    assert pricing.layer_activation_bytes(TINY, 32, 1) == 4 * 1056 + 512 + 1024 == 5760
    assert pricing.saved_activation_bytes(TINY.replace(remat_policy="full"), 32, 1) == 4 * 64
    # A bf16 model on CPU keeps q/k/v, RoPE, the attention and its output in float32 (a = 4):
    # 2 (4*64 + 4*128) + a ((2*4 + 3*2)*16 + 4*16) + 8*64 + 4*32*(4 + a), a = 2 on GPU.
    assert pricing.layer_activation_bytes(bf16, 32, 1, "gpu") == 1536 + 2 * 288 + 512 + 768
    assert pricing.layer_activation_bytes(bf16, 32, 1, "cpu") == 1536 + 4 * 288 + 512 + 1024
    # dots_no_batch keeps q/k/v (a (4 + 2*2) 16) and the MLP's and o/down's outputs in c.
    dots = bf16.replace(remat_policy="dots_no_batch")
    assert pricing.saved_activation_bytes(dots, 32, 1, "gpu") == 2 * 128 + 2 * (256 + 128)
    assert pricing.saved_activation_bytes(dots, 32, 1, "cpu") == 4 * 128 + 2 * (256 + 128)
    model = ModelSpec("actor", TINY, "causal_lm", False)
    step = ClosedFormPrices().call(model, MeshLayout(data=2, rules="decode"),
                                  Call("decode", 8, 48))
    kv = 4 * 48 * 512  # 4 rows per replica, 48 slots
    weights = 4 * TINY.num_params()
    logits = 4 * 256 * 4
    assert step.bytes_accessed == weights + kv + logits
    assert step.extra_bytes == kv + weights + 2 * logits


# Layers unrolled: XLA's cost analysis counts a loop body (a layer scan) once.
UNROLLED = TINY.replace(hidden_size=128, intermediate_size=384, num_heads=4, num_kv_heads=2,
                        head_dim=32, vocab_size=512, tie_word_embeddings=False,
                        scan_layers=False)


def _compiled(kind, rows, seq, scored_hidden):
    """The log-prob pass (or its gradient) of UNROLLED over int32 ids [rows, seq];
    `scored_hidden(model, ids)` gives the hidden states that go through the head."""
    graphdef, state = nnx.split(transformer.abstract(UNROLLED))

    def loss(params, ids):
        m = nnx.merge(graphdef, params)
        return jnp.sum(jax.nn.log_softmax(m.logits(scored_hidden(m, ids)), -1)[..., 0])

    fn = loss if kind == "forward" else jax.grad(loss)
    ids = jax.ShapeDtypeStruct((rows, seq), jnp.int32)
    return jax.jit(fn).lower(state, ids).compile()


@pytest.mark.parametrize("kind", ["forward", "train"])
def test_closed_forms_agree_with_compiled_programs(kind):
    cfg = UNROLLED
    rows, seq, scored = 8, 64, 32
    def scored_hidden(m, ids):
        hidden, _ = m.model(ids, jnp.ones_like(ids))
        return hidden[:, -scored - 1:-1]

    compiled = _compiled(kind, rows, seq, scored_hidden)
    cost = ClosedFormPrices().call(ModelSpec("actor", cfg, "causal_lm", True), MeshLayout(),
                                  Call(kind, rows, seq, scored, rows))
    flops = compiled.cost_analysis()["flops"]
    # The closed forms count matmuls only; norms, softmax and RoPE add a little.
    assert cost.flops <= flops <= 1.05 * cost.flops
    # Working memory: an estimate of what XLA keeps, within a factor of two of its temp bytes
    # (the gradients are the program's outputs there, so they are left out here).
    temp = compiled.memory_analysis().temp_size_in_bytes
    grads = 2 * pricing.param_shard_bytes(ModelSpec("actor", cfg, "causal_lm", True),
                                        MeshLayout())
    estimate = cost.extra_bytes - (grads if kind == "train" else 0)
    assert temp / 2 <= estimate <= 2.5 * temp


@pytest.mark.parametrize("kind", ["forward", "train"])
def test_shared_prompt_rows_agree_with_compiled_programs(kind):
    """The closed forms of shared-prompt rows against the actor's shared-row programs over
    the same padded rows."""
    groups, prompt, response, k = 2, 48, 32, 4
    call = Call(kind, groups, prompt + k * response, k * response, groups, k)
    assert call.context == prompt + response
    model = ModelSpec("actor", UNROLLED, "causal_lm", True)
    cost = ClosedFormPrices().call(model, MeshLayout(), call)
    compiled = _compiled(kind, groups * k, prompt + response, lambda m, ids: (
        shared_prompt.response_hidden(m.model, ids, jnp.ones_like(ids), response, k)))
    flops = compiled.cost_analysis()["flops"]
    assert cost.flops <= flops <= 1.05 * cost.flops
    # The prompt once per group instead of once per sample.
    padded = ClosedFormPrices().call(model, MeshLayout(), Call(
        kind, groups * k, prompt + response, response, groups * k))
    prompt_share = prompt / (prompt + response)
    assert cost.flops < (1 - 0.5 * prompt_share) * padded.flops
    with pytest.raises(ValueError, match="samples=3"):
        Call(kind, groups, prompt + k * response, k * response, groups, 3)


def test_the_simulator_prices_shared_rows_where_the_runs_use_them():
    w = Workload(prompts=4, n=4, prompt_len=64, response_len=64, actor_mini=16, actor_micro=8,
                 critic_mini=16, critic_micro=8, shared=4)
    sim = Simulator(cluster_for("h100"), w)
    actor, ref, critic = (ModelSpec(role, TINY, head, role != "ref")
                          for role, head in (("actor", "causal_lm"), ("ref", "causal_lm"),
                                             ("critic", "value")))
    one = MeshLayout(data=2)
    # 8-row micro-batches hold 2 groups: shared rows on 1 or 2 data-parallel devices.
    assert sim.train_call(actor, one) == (1, Call("train", 4, 64 + 4 * 64, 256, 2, 4))
    assert sim.score_call(ref, one)[1] == Call("forward", 4, 320, 256, 0, 4)
    # The critic never shares; on 4 devices 2 groups don't split: padded rows, as in the runs.
    assert sim.train_call(critic, one)[1] == Call("train", 16, 128, 64, 8)
    assert sim.train_call(actor, MeshLayout(data=4))[1] == Call("train", 16, 128, 64, 8)
    padded = Simulator(cluster_for("h100"), dataclasses.replace(w, shared=1))
    for stage in (sim.train, sim.forward):
        other = getattr(padded, stage.__name__)
        assert stage(actor, one).seconds < other(actor, one).seconds
        assert stage(critic, one).seconds == other(critic, one).seconds


SMALL = TINY.replace(vocab_size=64, hidden_size=16, intermediate_size=32, num_heads=8,
                     num_kv_heads=2, head_dim=4)
PAIRS = [("fsdp=8", "nested_train", 2), ("fsdp=4,tensor=2", "nested_train", 2),
         ("fsdp=4,tensor=2", "train", 2), ("fsdp=2,tensor=4", "nested_train", 1),
         ("data=2,fsdp=2,tensor=2", "train", 2), ("data=2,fsdp=4", "nested_train", 4),
         ("fsdp=8", "train", 1), ("tensor=8", "train", 4), ("fsdp=8", "train", 2),
         ("data=4,tensor=2", "train", 2), ("data=8", "train", 2)]


@pytest.mark.parametrize("train,rules,t_g", PAIRS)
def test_transition_bytes_match_the_engine(train, rules, t_g):
    state = nnx.state(transformer.abstract(SMALL))
    spec = MeshSpec.parse(train)
    decode = f"data={8 // t_g},tensor={t_g}"
    try:
        engine = hybrid.HybridEngine(shd.layout(spec.build(jax.devices()), rules), decode, state)
    except hybrid.LayoutError:
        with pytest.raises(virtual.NoNesting):
            virtual.transition_bytes(virtual.leaves_of(state), rules, spec.resolve(8), t_g)
        return
    received, held = virtual.transition_bytes(virtual.leaves_of(state), rules, spec.resolve(8),
                                              t_g)
    assert received == reshard.max_bytes(engine.bytes_to_decode())
    assert held == reshard.max_bytes(engine.decode_bytes())


def test_transition_bytes_are_table2_at_scale():
    # 128 devices no machine here has: fsdp=16 x tensor=8 under train rules gathers each
    # device's decode shard (1/t_g of the split weights) from its 1/(fsdp*tensor) share.
    cfg = get_preset("llama2-7b")
    leaves = pricing.model_leaves(ModelSpec("actor", cfg))
    received, held = virtual.transition_bytes(leaves, "train", virtual.mesh_sizes(fsdp=16,
                                                                                  tensor=8), 4)
    split = sum(leaf.nbytes for leaf in leaves if leaf.axes and "norm" not in leaf.axes)
    np.testing.assert_allclose(received, split / 4 - split / 128, rtol=1e-9)
    assert held == pytest.approx(split / 4 + (sum(x.nbytes for x in leaves) - split))

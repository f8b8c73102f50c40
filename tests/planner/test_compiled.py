"""Compiled prices: XLA's figures of the model's programs at abstract shapes, against the closed
forms and against a program compiled with all its layers; the per-program cache; the closed
forms where a program cannot be compiled; re-pricing a search's finalists."""

import jax
import pytest

from hfjax.models.presets import get_preset
from hfjax.planner import search
from hfjax.planner.compiled import CompiledPrices, compile_pass
from hfjax.planner.pricing import Call, ClosedFormPrices, MeshLayout, ModelSpec
from hfjax.planner.refine import reprice
from hfjax.planner.simulator import Workload, cluster_for

# Small enough to compile in a moment, large enough that matmuls dominate the FLOPs.
CFG = get_preset("tiny").replace(hidden_size=128, intermediate_size=384, num_heads=4,
                                 num_kv_heads=2, head_dim=32, vocab_size=512, num_layers=3,
                                 tie_word_embeddings=False)
ACTOR = ModelSpec("actor", CFG, "causal_lm", True)

CALLS = {"forward": Call("forward", 8, 64, 32), "train": Call("train", 8, 64, 32, 4),
         "prefill": Call("prefill", 8, 32), "decode": Call("decode", 8, 64)}


@pytest.fixture(scope="module")
def compiled():
    return CompiledPrices("cpu", budget_s=None)


@pytest.mark.parametrize("kind", list(CALLS))
def test_compiled_prices_agree_with_the_closed_forms(compiled, kind):
    """Within stated factors on a tiny model: FLOPs within 10% (the closed forms count matmuls
    only; norms, softmax and RoPE add ~2% here), working memory within 3x either way (the
    closed forms estimate what XLA keeps), and bytes accessed at least the closed forms'
    traffic (XLA:CPU counts every operation's operands, up to 10x the HBM traffic a fused
    accelerator program has)."""
    lay = MeshLayout(fsdp=2)
    got = compiled.call(ACTOR, lay, CALLS[kind])
    closed = ClosedFormPrices("cpu").call(ACTOR, lay, CALLS[kind])
    assert closed.flops <= got.flops <= 1.10 * closed.flops
    assert closed.extra_bytes / 3 <= got.extra_bytes <= 3 * closed.extra_bytes
    assert closed.bytes_accessed <= got.bytes_accessed <= 12 * closed.bytes_accessed
    assert not compiled.fallbacks


def test_figures_extrapolated_from_one_and_two_layers_are_the_whole_models(compiled):
    """The source compiles 1- and 2-layer copies (XLA counts a scanned layer once); the
    extrapolation to 3 layers matches the 3-layer program compiled unrolled."""
    call = CALLS["train"]
    got = compiled.figures(ACTOR, MeshLayout(), call)
    flops, nbytes, extra = compile_pass(ACTOR, "train", jax.devices()[:1], call, call.micro,
                                        3, "cpu")
    assert got.flops == pytest.approx(flops, rel=0.01)
    assert got.bytes_accessed == pytest.approx(nbytes, rel=0.05)
    assert got.extra_bytes == pytest.approx(extra, rel=0.1)


def test_tensor_parallelism_splits_a_devices_work_and_the_cache_holds(compiled):
    call = CALLS["forward"]
    one = compiled.call(ACTOR, MeshLayout(), call)
    two = compiled.call(ACTOR, MeshLayout(tensor=2), call)
    assert two.flops == pytest.approx(one.flops / 2, rel=0.05)
    before = compiled.compiles
    # Same per-device rows and tensor size: the same program, not compiled again.
    assert compiled.call(ACTOR, MeshLayout(tensor=2), call) == two
    assert compiled.call(ACTOR, MeshLayout(data=2), Call("forward", 16, 64, 32)) == one
    # A training call's micro-batches multiply one micro-batch's figures.
    train = compiled.call(ACTOR, MeshLayout(), Call("train", 8, 64, 32, 8))
    assert compiled.call(ACTOR, MeshLayout(), Call("train", 16, 64, 32, 8)).flops == (
        pytest.approx(2 * train.flops))
    assert compiled.compiles == before + 2  # only the training call's 1- and 2-layer programs


def test_the_closed_forms_price_what_cannot_be_compiled():
    closed = ClosedFormPrices("cpu")
    two = CompiledPrices("cpu", devices=jax.devices()[:2])
    call = CALLS["forward"]
    # More tensor devices than this source has.
    assert two.call(ACTOR, MeshLayout(tensor=4), call) == closed.call(ACTOR, MeshLayout(tensor=4),
                                                                     call)
    # A program that cannot be laid out: tensor=3 divides neither the heads nor the vocabulary.
    three = CompiledPrices("cpu", devices=jax.devices()[:3])
    assert three.call(ACTOR, MeshLayout(tensor=3), call) == closed.call(
        ACTOR, MeshLayout(tensor=3), call)
    # Shared-prompt rows, and a spent compile budget.
    shared = Call("forward", 2, 48 + 4 * 16, 64, 0, 4)
    spent = CompiledPrices("cpu", budget_s=0)
    assert spent.call(ACTOR, MeshLayout(), call) == closed.call(ACTOR, MeshLayout(), call)
    assert two.call(ACTOR, MeshLayout(), shared) == closed.call(ACTOR, MeshLayout(), shared)
    reasons = " | ".join([*two.fallbacks.values(), *three.fallbacks.values(),
                          *spent.fallbacks.values()])
    assert "tensor=4 needs 4 devices to compile on; this process has 2" in reasons
    assert "size 3) do not divide" in " ".join(three.fallbacks.values())
    assert "shared-prompt rows" in reasons
    assert "compile budget of 0 s spent" in reasons
    assert two.compiles == three.compiles == spent.compiles == 0


def _plan_inputs():
    cfg = get_preset("tiny").replace(num_heads=4, num_kv_heads=2)
    models = [ModelSpec("actor", cfg, "causal_lm", True), ModelSpec("ref", cfg, "causal_lm")]
    w = Workload(prompts=8, n=2, prompt_len=16, response_len=16, actor_mini=16, actor_micro=8)
    return models, w


def test_reprice_keeps_the_layouts_and_takes_the_new_prices():
    models, w = _plan_inputs()
    cluster = cluster_for("cpu")
    result = search.plan(models, w, cluster, 2, alternatives=1)
    # A source that compiles nothing prices as the closed forms: the same plans, same times.
    same = reprice(result, models, CompiledPrices("cpu", budget_s=0))
    assert [p.iteration_s for p in same.alternatives] == pytest.approx(
        [p.iteration_s for p in result.alternatives])
    assert same.best.iteration_s == pytest.approx(result.best.iteration_s)
    # Compiled: every plan keeps its pools and meshes; the times are the compiled figures'.
    costs = CompiledPrices("cpu", budget_s=None)
    again = reprice(result, models, costs)
    before = {p.placement_key: p for p in [result.best, *result.alternatives]}
    for p in [again.best, *again.alternatives]:
        old = before[p.placement_key]
        assert p.meshes() == old.meshes() and p.pools == old.pools
        assert p.iteration_s != old.iteration_s
    assert again.best.iteration_s <= min(p.iteration_s for p in again.alternatives)
    assert costs.priced and not costs.fallbacks

"""Sequence parallelism (hfjax.models.sequence_parallel): rows split over the `sequence` mesh
axis give the logits, values and gradients of whole rows (float32, within 1e-5), by Ulysses and
by ring attention, for padded, packed and shared-prompt rows; and the head-count check."""

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hfjax.models import sequence_parallel as sp
from hfjax.models import transformer
from hfjax.models.attention import ResponseBlocks, SharedPrompt
from hfjax.models.config import ModelConfig
from hfjax.parallel import sharding as shd
from hfjax.parallel.mesh import ResourcePool
from hfjax.workers.base import WorkerGroup

CFG = ModelConfig(vocab_size=48, hidden_size=32, intermediate_size=48, num_layers=2,
                  num_heads=8, num_kv_heads=4, head_dim=8)  # 2 query heads per kv head
B, T = 4, 22  # 22 columns: not a multiple of 4, so the split row is padded


def layout(mesh: str | None, mode: str = "ulysses"):
    if mesh is None:
        return None
    n = int(np.prod([int(item.split("=")[1]) for item in mesh.split(",")]))
    pool = ResourcePool("all", tuple(jax.devices())[:n])
    return shd.layout(pool.mesh(mesh), "train", sequence_parallel=mode)


def padded():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, CFG.vocab_size, (B, T))
    col = np.arange(T)[None, :]
    first, end = np.array([0, 5, 9, 3]), np.array([22, 19, 20, 13])
    mask = (col >= first[:, None]) & (col < end[:, None])
    return dict(input_ids=jnp.asarray(ids, jnp.int32)), jnp.asarray(mask)


def packed():
    """Rows holding 2-3 sequences end to end (`hfjax.engine.packing`'s layout)."""
    rng = np.random.default_rng(1)
    lengths = [[7, 9, 4], [12, 6], [5, 5, 8], [20]]
    seg, pos = np.zeros((B, T), np.int32), np.zeros((B, T), np.int32)
    for r, ls in enumerate(lengths):
        c = 0
        for s, n in enumerate(ls, start=1):
            seg[r, c:c + n], pos[r, c:c + n] = s, np.arange(n)
            c += n
    ids = rng.integers(0, CFG.vocab_size, (B, T))
    return (dict(input_ids=jnp.asarray(ids, jnp.int32), positions=jnp.asarray(pos),
                 segment_ids=jnp.asarray(seg), segment_span=12), jnp.asarray(seg > 0))


def shared():
    """Rows of one left-padded prompt (6 columns) and 2 right-padded responses (8 each)."""
    rng = np.random.default_rng(2)
    P, n, R = 6, 2, 8
    width = P + n * R
    prompt_first = np.array([0, 2, 4, 1])
    resp_len = np.array([[8, 3], [5, 8], [1, 6], [7, 2]])
    mask, pos = np.zeros((B, width), bool), np.zeros((B, width), np.int32)
    for r in range(B):
        mask[r, prompt_first[r]:P] = True
        plen = P - prompt_first[r]
        pos[r, prompt_first[r]:P] = np.arange(plen)
        for k in range(n):
            s = P + k * R
            mask[r, s:s + resp_len[r, k]] = True
            pos[r, s:s + R] = plen + np.arange(R)
    ids = rng.integers(0, CFG.vocab_size, (B, width))
    return (dict(input_ids=jnp.asarray(ids, jnp.int32), positions=jnp.asarray(pos),
                 shared_prompt=SharedPrompt(P, n)), jnp.asarray(mask))


def compact():
    """Compact shared-prompt rows: a 5-column prompt (block 0), then responses end to end."""
    rng = np.random.default_rng(3)
    blocks = np.full((B, T), -1, np.int32)
    pos = np.zeros((B, T), np.int32)
    lengths = [[6, 9], [4, 4, 3], [10], [8, 2, 7]]
    for r, ls in enumerate(lengths):
        blocks[r, :5], pos[r, :5] = 0, np.arange(5)
        c = 5
        for k, n in enumerate(ls, start=1):
            blocks[r, c:c + n], pos[r, c:c + n] = k, 5 + np.arange(n)
            c += n
    ids = rng.integers(0, CFG.vocab_size, (B, T))
    return (dict(input_ids=jnp.asarray(ids, jnp.int32), positions=jnp.asarray(pos),
                 response_blocks=ResponseBlocks(jnp.asarray(blocks), 5, 10)),
            jnp.asarray(blocks >= 0))


ROWS = {"padded": padded, "packed": packed, "shared": shared, "compact": compact}


def outputs_and_grads(head: str, rows: str, lay, impl: str = "dense", cfg=CFG):
    """The head's outputs on real tokens and the gradient of a weighted sum of them, with the
    model's forward traced under `lay`."""
    kw, mask = ROWS[rows]()
    cfg = dataclasses.replace(cfg, attention_impl=impl)
    graphdef, state = nnx.split(transformer.build(cfg, head, seed=1))
    static = {k: v for k, v in kw.items() if not isinstance(v, jax.Array)}
    arrays = {k: v for k, v in kw.items() if isinstance(v, jax.Array)}
    attn_mask = None if "segment_ids" in kw else mask.astype(jnp.int32)
    if "response_blocks" in kw:
        static.pop("response_blocks")
        arrays["blocks"] = kw["response_blocks"].blocks

    def loss(state, arrays):
        a = dict(arrays)
        if "blocks" in a:
            a["response_blocks"] = kw["response_blocks"]._replace(blocks=a.pop("blocks"))
        out = nnx.merge(graphdef, state)(attention_mask=attn_mask, **a, **static)
        if head == "causal_lm":
            out = jax.nn.log_softmax(out)[..., :7] @ jnp.arange(7.0)
        weighted = jnp.where(mask, out * jnp.linspace(0.5, 1.5, out.shape[1]), 0.0)
        return jnp.sum(weighted) / jnp.sum(mask), out  # a mean: gradients of order 1

    fn = jax.value_and_grad(loss, has_aux=True)
    (_, out), grads = jax.jit(shd.under_layout(lay, fn))(state, arrays)
    return np.asarray(out)[np.asarray(mask)], [np.asarray(g) for g in jax.tree.leaves(grads)]


def assert_same(got, want, tol=1e-5):
    np.testing.assert_allclose(got[0], want[0], rtol=tol, atol=tol)
    for g, w in zip(got[1], want[1], strict=True):
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol)


@pytest.mark.parametrize("rows", sorted(ROWS))
@pytest.mark.parametrize("mode", sp.MODES)
def test_split_rows_equal_whole_rows(rows, mode):
    want = outputs_and_grads("causal_lm", rows, None)
    meshes = ("sequence=4", "fsdp=2,sequence=4") if rows == "padded" else ("fsdp=2,sequence=4",)
    for mesh in meshes:
        assert_same(outputs_and_grads("causal_lm", rows, layout(mesh, mode)), want)


@pytest.mark.parametrize("mode", sp.MODES)
def test_values_and_blockwise_attention_split(mode):
    want = outputs_and_grads("value", "padded", None)
    assert_same(outputs_and_grads("value", "padded", layout("fsdp=2,sequence=4", mode)), want)
    # Ulysses runs the row's own attention on its heads: here the blockwise kernel.
    assert_same(outputs_and_grads("value", "packed", layout("fsdp=2,sequence=2,tensor=2", mode),
                                  impl="blockwise"),
                outputs_and_grads("value", "packed", None, impl="blockwise"))


def test_activations_are_split_over_sequence():
    lay = layout("fsdp=2,sequence=4")
    kw, mask = padded()
    model = transformer.build(CFG, seed=1)
    graphdef, state = nnx.split(model)

    def hidden(state, ids, mask):
        return nnx.merge(graphdef, state).model(ids, mask)[0]

    text = jax.jit(shd.under_layout(lay, hidden)).lower(
        state, kw["input_ids"], mask.astype(jnp.int32)).compile().as_text()
    assert "all-to-all" in text  # Ulysses' exchanges
    # The embeddings come out [B/2, 24/4, D] per device: rows padded to 24, split 4 ways.
    assert "f32[2,6,32]" in text


@pytest.mark.parametrize("rows", ["padded", "shared"])
@pytest.mark.parametrize("balanced", [True, False])
def test_ring_attention_by_key_blocks_equals_whole_rows(rows, balanced, monkeypatch):
    """Ring attention folding each half-shard's keys in blocks of 2 (the last padded with a
    masked key), the causally empty half-shard pairs skipped, with the zig-zag placement and
    without it: whole rows' numbers and gradients within 1e-5. sequence=2 on 22 columns gives
    11 per device, an odd count: the second half-shard is padded by one column."""
    monkeypatch.setattr(sp, "RING_K_BLOCK", 2)
    monkeypatch.setattr(sp, "RING_BALANCED", balanced)
    want = outputs_and_grads("causal_lm", rows, None)
    for mesh in ("fsdp=2,sequence=4", "sequence=2"):
        assert_same(outputs_and_grads("causal_lm", rows, layout(mesh, "ring")), want)


def test_ring_placement_balances_the_causal_work():
    """The zig-zag placement: every device holds one early and one late half-shard, and computes
    the same number of half-shard pairs; the plain placement leaves the last device 4s - 1."""
    for s in (2, 4, 8):
        chunks = sorted(c for d in range(s) for c in sp.ring_chunks(d, s, True))
        assert chunks == list(range(2 * s))
        # Loop-count of the causally non-empty pairs: query chunk qc sees key chunk kc <= qc.
        want = {bal: [sum(1 for qc in sp.ring_chunks(d, s, bal) for kc in range(2 * s)
                          if kc <= qc) for d in range(s)] for bal in (True, False)}
        assert sp.ring_pairs(s, True) == want[True] == [2 * s + 1] * s
        assert sp.ring_pairs(s, False) == want[False] == [4 * d + 3 for d in range(s)]


def test_ulysses_repeats_kv_heads_fewer_than_the_sequence_size():
    """2 kv heads on sequence=4 (each repeated twice before the all-to-all), and 1 per tensor
    shard on tensor=2,sequence=4 (repeated 4 times): whole rows' numbers within 1e-5."""
    cfg = dataclasses.replace(CFG, num_kv_heads=2)  # 4 query heads per kv head
    want = outputs_and_grads("causal_lm", "padded", None, cfg=cfg)
    for mesh in ("fsdp=2,sequence=4", "sequence=4,tensor=2"):
        assert_same(outputs_and_grads("causal_lm", "padded", layout(mesh), cfg=cfg), want)
    assert [sp.kv_repeats(k, 4) for k in (1, 2, 3, 4, 8)] == [4, 2, 4, 1, 1]


def test_ulysses_needs_query_heads_divisible_by_the_sequence_size():
    pool = ResourcePool("all", tuple(jax.devices()))
    cfg = dataclasses.replace(CFG, num_heads=6, num_kv_heads=2)
    with pytest.raises(ValueError, match=r"actor.sequence_parallel=ulysses .* 6 query heads.*"
                                         r"use actor.sequence_parallel=ring"):
        WorkerGroup("actor", pool, "fsdp=2,sequence=4", transformer.build(cfg))
    group = WorkerGroup("actor", pool, "fsdp=2,sequence=4", transformer.build(cfg),
                        sequence_parallel="ring")
    assert group.layout.sequence_parallel == "ring"
    assert WorkerGroup("actor", pool, "fsdp=2,sequence=4",  # kv heads need not divide
                       transformer.build(dataclasses.replace(CFG, num_kv_heads=2)))
    with pytest.raises(ValueError, match="choose one of"):
        WorkerGroup("actor", pool, "fsdp=8", transformer.build(cfg), sequence_parallel="rings")


def test_parameters_are_sharded_over_fsdp_and_sequence():
    from jax.sharding import PartitionSpec as P

    assert layout("fsdp=2,sequence=4").spec(("embed", "mlp"), (32, 48)) == P(("fsdp", "sequence"))
    assert layout("fsdp=8").spec(("embed", "mlp"), (32, 48)) == P("fsdp")


def test_presets_fewer_kv_heads_than_the_sequence_size_are_accepted():
    """Qwen2.5-1.5B (12 query, 2 kv heads) on fsdp=2,sequence=4 by Ulysses, built as a run
    builds it (the dry run's abstract groups) and its log-prob program traced with its kv heads
    repeated twice; Llama-3.1-70B (64 query, 8 kv heads) on tensor=2,sequence=8 (4 kv heads
    per tensor shard, repeated twice): no refusal. The 70B needs 16 devices, more than the
    suite simulates: docs/scaling.md shows its 16-device dry run (smoke tier)."""
    import sys

    sys.path.insert(0, "tests")
    from support import tiny_rl_config

    from hfjax.models import presets
    from hfjax.run import dry_run

    c = tiny_rl_config(algorithm="grpo", mesh="fsdp=2,sequence=4")
    c.model.path = "preset:qwen2.5-1.5b"
    c.data.train_batch_size, c.data.max_prompt_length, c.rollout.n = 8, 16, 2
    c.algo.adv_estimator = "grpo"
    for role in ("actor", "ref"):
        c[role].sequence_parallel = "ulysses"
    w = dry_run.abstract_groups(c, platform="gpu")
    shape = dry_run.step_shape(w, c)
    (program,) = [p for p in w.actor.programs(shape) if p.name == "actor.log_prob"]
    text = program.fn.lower(*program.args).as_text()
    assert "all_to_all" in text or "all-to-all" in text
    q15, q70 = presets.get_preset("qwen2.5-1.5b"), presets.get_preset("llama3.1-70b")
    assert (q15.num_heads, q15.num_kv_heads, q70.num_heads, q70.num_kv_heads) == (12, 2, 64, 8)
    assert sp.heads_problem(64, 8, {"tensor": 2, "sequence": 8}, "ulysses") is None
    assert sp.kv_repeats(8 // 2, 8) == 2


@pytest.mark.parametrize("mode", sp.MODES)
def test_shared_prompt_log_probs_split_equal_padded_whole_rows(mode):
    """The actor's log-probs and entropies of groups of 3 samples scored as shared-prompt rows
    split over `sequence` (the head on each device's own columns, chunked; a response's first
    token from the prompt's last position), against the padded rows scored whole: values and
    gradients within 1e-5."""
    from hfjax.workers.logprobs import response_logprobs

    rng = np.random.default_rng(3)
    n, P, R = 3, 6, 5
    prompts = rng.integers(1, CFG.vocab_size, (2, P)).repeat(n, axis=0)
    ids = np.concatenate([prompts, rng.integers(1, CFG.vocab_size, (2 * n, R))], axis=1)
    col = np.arange(P + R)[None, :]
    first = np.array([2, 0]).repeat(n)[:, None]  # the prompts' left padding, per group
    end = P + np.array([5, 3, 1, 5, 4, 2])[:, None]  # each response's length
    mask = ((col >= first) & (col < end)).astype(np.int32)
    ids = jnp.asarray(np.where(mask, ids, 0), jnp.int32)
    graphdef, state = nnx.split(transformer.build(CFG, seed=1))
    resp = jnp.asarray(mask[:, P:], jnp.float32)
    weight = jnp.linspace(0.5, 1.5, R)

    def run(lay, samples):
        def loss(state):
            lp, ent = response_logprobs(nnx.merge(graphdef, state), ids, jnp.asarray(mask), R,
                                        0.7, samples=samples, chunk=3, dp=2)
            return jnp.sum((lp + 0.3 * ent) * weight * resp) / jnp.sum(resp), (lp, ent)

        fn = jax.value_and_grad(loss, has_aux=True)
        (_, (lp, ent)), grads = jax.jit(shd.under_layout(lay, fn))(state)
        keep = np.asarray(resp) > 0
        return (np.concatenate([np.asarray(lp)[keep], np.asarray(ent)[keep]]),
                [np.asarray(g) for g in jax.tree.leaves(grads)])

    assert_same(run(layout("fsdp=2,sequence=4", mode), n), run(None, 1))


@pytest.mark.parametrize("mode", sp.MODES)
def test_compact_shared_rows_log_probs_split_equal_whole_rows(mode, monkeypatch):
    """Compact shared-prompt rows (length-grouped micro-batches: each response only as long as
    it is) split over `sequence`: the actor's log-probs, entropies and their gradients equal
    the same rows scored whole, within 1e-5."""
    sys.path.insert(0, "tests")
    from support import padded_rl_batch

    from hfjax.engine import grouping, shared_prompt
    from hfjax.workers.logprobs import compact_logprobs

    monkeypatch.setattr(shared_prompt, "COMPACT_MAX_FRACTION", 1.0)
    n, P, R = 2, 7, 9
    batch = padded_rl_batch(5, 2 * 2 * n, P, R, CFG.vocab_size, samples=n)
    arrays = {k: jnp.asarray(batch[k]) for k in ("input_ids", "attention_mask", "responses")}
    (cut,) = grouping.plan(grouping.extents(arrays["attention_mask"], R), len(batch["input_ids"]),
                           P, R, 2, group=n)
    assert cut.compact is not None
    mb = grouping.cut(arrays, cut, R)
    graphdef, state = nnx.split(transformer.build(CFG, seed=1))
    m = np.asarray(batch["response_mask"]) > 0

    def run(lay):
        def loss(state):
            lp, ent = compact_logprobs(nnx.merge(graphdef, state), mb, 0.7, n, chunk=3, dp=2)
            return jnp.sum(jnp.where(jnp.asarray(m), lp + 0.3 * ent, 0.0)), (lp, ent)

        fn = jax.value_and_grad(loss, has_aux=True)
        (_, (lp, ent)), grads = jax.jit(shd.under_layout(lay, fn))(state)
        return (np.concatenate([np.asarray(lp)[m], np.asarray(ent)[m]]),
                [np.asarray(g) for g in jax.tree.leaves(grads)])

    assert_same(run(layout("fsdp=2,sequence=4", mode)), run(None))

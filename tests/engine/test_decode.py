"""The decode step (hfjax.engine.decode) over its two-part cache (prompt columns, response
columns) against the model's own forward pass over a `KVCache` of all the columns (one
softmax over the row): same logits up to float rounding, same columns written; and each way
of reading the cache (`DecodeOptions`: chunked, Pallas, the GPU layout) against the CPU's."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
from hf_fixtures import make_hf_model  # noqa: E402

import hfjax.models as M  # noqa: E402
from hfjax.engine.decode import (  # noqa: E402
    DecodeOptions,
    LayerCache,
    cache_columns,
    decode_options,
    decode_step,
    empty_cache,
    pallas_blocks,
    split_layers,
)
from hfjax.models.transformer import KVCache  # noqa: E402

PROMPT, NEW, ROWS = 16, 64, 4  # widths the Pallas kernel takes (pallas_blocks)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("llama"))
    make_hf_model("llama", d)
    return M.load(d)


def random_columns(cfg, seed=0):
    """Finite random keys [layers, rows, kv, hd, columns] and values [layers, rows, kv,
    columns, hd] for every column, so a column read or written where it should not be would
    change the result."""
    rng = np.random.default_rng(seed)
    kv, hd, cols = cfg.num_kv_heads, cfg.head_dim, PROMPT + NEW
    k = rng.standard_normal((cfg.num_layers, ROWS, kv, hd, cols)).astype(np.float32)
    v = rng.standard_normal((cfg.num_layers, ROWS, kv, cols, hd)).astype(np.float32)
    return k, v


def two_parts(k, v):
    return tuple(
        LayerCache(jnp.asarray(k[i, ..., :PROMPT]), jnp.asarray(v[i, :, :, :PROMPT]),
                   jnp.asarray(k[i, ..., PROMPT:]), jnp.asarray(v[i, :, :, PROMPT:]))
        for i in range(k.shape[0])
    )


def inputs(slot):
    # Left padding on two rows: their first columns are masked.
    mask = jnp.ones((ROWS, PROMPT + NEW), jnp.int32).at[1, :3].set(0).at[3, :7].set(0)
    tokens = jnp.arange(ROWS, dtype=jnp.int32) + 5
    positions = jnp.broadcast_to(jnp.asarray(slot), (ROWS,)) - jnp.array([0, 3, 0, 7])
    return tokens, positions, mask


@pytest.mark.parametrize("fuse", [False, True], ids=["separate", "fused"])
def test_two_parts_equal_the_models_cached_forward(llama, fuse):
    """One column for every row (the static engine) against `model.model` with a KVCache
    [layers, rows, columns, kv_heads, head_dim] written at `cache_index`; with the layers'
    q/k/v and gate/up weights separate (the CPU's) and fused (GPUs' and TPUs')."""
    k, v = random_columns(llama.config)
    slot = PROMPT + 17
    tokens, positions, mask = inputs(slot)
    layers = split_layers(llama, fuse=fuse)
    assert ("qkv_proj" in layers[0]) == fuse and ("gate_up_proj" in layers[0]) == fuse
    got_logits, got = jax.jit(lambda c: decode_step(
        llama, layers, tokens, positions, mask, c, jnp.int32(slot)))(two_parts(k, v))

    def forward(cache):
        h, cache = llama.model(tokens[:, None], mask, positions=positions[:, None], cache=cache,
                               cache_index=slot)
        return llama.logits(h[:, 0]), cache

    full = KVCache(jnp.asarray(np.transpose(k, (0, 1, 4, 2, 3))),
                   jnp.asarray(np.transpose(v, (0, 1, 3, 2, 4))))
    want_logits, want = jax.jit(forward)(full)
    np.testing.assert_allclose(np.asarray(got_logits), np.asarray(want_logits), atol=2e-5,
                               rtol=1e-5)
    # Every layer wrote its key and value at the slot's column, as the model's pass did (up to
    # the rounding of the projections and of the attention below), and no other column.
    for i, g in enumerate(got):
        np.testing.assert_allclose(np.concatenate([g.prompt_k, g.k], -1),
                                   np.transpose(want.k[i], (0, 2, 3, 1)), atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(np.concatenate([g.prompt_v, g.v], -2),
                                   np.transpose(want.v[i], (0, 2, 1, 3)), atol=1e-5, rtol=1e-5)
        others = np.arange(PROMPT + NEW) != slot
        np.testing.assert_array_equal(np.concatenate([g.prompt_k, g.k], -1)[..., others],
                                      k[i][..., others])


def test_per_row_columns(llama):
    """One column per row (continuous batching): each row writes its own response column and
    only that one, and its logits equal the one-column step's for that row's column."""
    k, v = random_columns(llama.config)
    slots = np.array([PROMPT, PROMPT + 9, PROMPT + NEW - 1, PROMPT + 30], np.int32)
    tokens, positions, mask = inputs(slots)
    layers = split_layers(llama)
    step = jax.jit(lambda c, s, pos: decode_step(llama, layers, tokens, pos, mask, c, s))
    logits, cache = step(two_parts(k, v), jnp.asarray(slots), positions)
    for r, s in enumerate(slots):
        alone_logits, _ = step(two_parts(k, v), jnp.int32(s), inputs(s)[1])
        np.testing.assert_allclose(np.asarray(logits[r]), np.asarray(alone_logits[r]),
                                   atol=2e-5, rtol=1e-5)
    before = k[0, ..., PROMPT:]
    after = np.asarray(cache[0].k)
    for r, s in enumerate(slots):
        changed = np.flatnonzero((before[r] != after[r]).any(axis=(0, 1)))
        assert changed.tolist() == [s - PROMPT]
    np.testing.assert_array_equal(np.asarray(cache[0].prompt_k), k[0, ..., :PROMPT])


def test_empty_cache_shapes(llama):
    cfg = llama.config
    cache = empty_cache(cfg, 3, 16, 24)
    assert len(cache) == cfg.num_layers and cache_columns(cache[0]) == 40
    gpu = empty_cache(cfg, 3, 16, 24, "gpu")
    assert cache_columns(gpu[0], "gpu") == 40
    assert gpu[0].prompt_k.shape == gpu[0].prompt_v.shape == (3, 16, cfg.num_kv_heads,
                                                             cfg.head_dim)
    assert cache[0].prompt_k.shape == (3, cfg.num_kv_heads, cfg.head_dim, 16)
    assert cache[0].v.shape == (3, cfg.num_kv_heads, 24, cfg.head_dim)


def in_layout(cache, layout):
    """A "cpu"-layout cache (LayerCache per layer) in `layout`: "gpu" keys and values are
    [rows, columns, kv_heads, head_dim]."""
    if layout == "cpu":
        return cache
    return tuple(LayerCache(jnp.transpose(c.prompt_k, (0, 3, 1, 2)), jnp.swapaxes(c.prompt_v, 1, 2),
                            jnp.transpose(c.k, (0, 3, 1, 2)), jnp.swapaxes(c.v, 1, 2))
                 for c in cache)


def to_cpu(cache, layout):
    if layout == "cpu":
        return cache
    return tuple(LayerCache(jnp.transpose(c.prompt_k, (0, 2, 3, 1)), jnp.swapaxes(c.prompt_v, 1, 2),
                            jnp.transpose(c.k, (0, 2, 3, 1)), jnp.swapaxes(c.v, 1, 2))
                 for c in cache)


VARIANTS = {
    "chunked-cpu-7": DecodeOptions("chunked", "cpu", 7),  # 64 columns: a short last chunk
    "chunked-gpu-16": DecodeOptions("chunked", "gpu", 16),
    "full-gpu": DecodeOptions("full", "gpu"),
    "pallas-gpu": DecodeOptions("pallas", "gpu", interpret=True),
}


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("per_row", [False, True], ids=["one_column", "per_row"])
def test_variants_equal_the_full_read(llama, name, per_row):
    if name.startswith("pallas"):
        assert pallas_blocks(PROMPT) and pallas_blocks(NEW)  # the kernel reads both parts
    """Each way of reading the cache gives the CPU full-width read's logits and writes the
    same columns, for one column of every row and for one column per row (rows at different
    steps, one of them in the first response column)."""
    opts = VARIANTS[name]
    k, v = random_columns(llama.config)
    slot = (np.array([PROMPT, PROMPT + 9, PROMPT + 21, PROMPT + 3], np.int32) if per_row
            else np.int32(PROMPT + 17))
    tokens, positions, mask = inputs(slot)
    layers = split_layers(llama)
    base = two_parts(k, v)
    want_logits, want = jax.jit(lambda c: decode_step(
        llama, layers, tokens, positions, mask, c, jnp.asarray(slot)))(base)
    got_logits, got = jax.jit(lambda c: decode_step(
        llama, layers, tokens, positions, mask, c, jnp.asarray(slot), opts))(
            in_layout(base, opts.layout))
    np.testing.assert_allclose(np.asarray(got_logits), np.asarray(want_logits), atol=2e-5,
                               rtol=1e-5)
    for g, w in zip(to_cpu(got, opts.layout), want):
        for a, b in zip(g, w):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_options_resolve_per_platform():
    from hfjax.models import backend

    assert decode_options() == DecodeOptions("full", "cpu")
    with backend.compiling_for("gpu"):
        # "auto" is the Pallas read on a GPU; the kernel cannot run on these CPU devices, so
        # the chunked read stands in (a dry run for a GPU target).
        assert decode_options()[:2] == ("chunked", "gpu")
        assert decode_options("pallas")[:2] == ("chunked", "gpu")
    with backend.compiling_for("tpu"):
        assert decode_options("auto", "cpu")[:2] == ("full", "cpu")
        assert decode_options()[:2] == ("full", "gpu")
    with pytest.raises(ValueError, match="kv_layout=gpu"):
        decode_options("pallas", "cpu")
    with pytest.raises(ValueError, match="rollout.decode_attention='paged'"):
        decode_options("paged")

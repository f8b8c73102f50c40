"""The rollout sampler against HF transformers, teacher-forced log-probs and NumPy references."""

import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
from hf_fixtures import left_padded_batch, make_hf_model  # noqa: E402

import hfjax.models as M  # noqa: E402
from hfjax.engine import Sampler, SamplingParams, bucket_size, generate  # noqa: E402
from hfjax.models.config import ModelConfig  # noqa: E402
from hfjax.parallel.mesh import MeshSpec  # noqa: E402

LENGTHS = (9, 5, 12, 1)


# ---------------------------------------------------------------------------------------------
# Independent references (NumPy, loop-based)
# ---------------------------------------------------------------------------------------------


def chi2_quantile(df: int, z: float) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile whose normal z-score is z.

    Accurate to ~1% for df >= 3 (df=7, z=3.09: 24.5 vs the tabled 24.32 at p=0.001); used
    because scipy is not a dependency.
    """
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


Z_1E4 = 3.719  # one-sided normal quantile for p = 1e-4: a correct sampler fails 1 run in 10^4


def chi2_stat(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic over cells with expected count >= 5 (the rest pooled into one).

    Returns (statistic, degrees of freedom).
    """
    total = counts.sum()
    expected = probs * total
    big = expected >= 5
    obs = list(counts[big]) + ([counts[~big].sum()] if (~big).any() else [])
    exp = list(expected[big]) + ([expected[~big].sum()] if (~big).any() else [])
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp) if e > 0)
    return float(stat), len(obs) - 1


def softmax64(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def truncated_probs(logits, temperature, top_k=0, top_p=1.0, min_p=0.0, margin=1e-4):
    """The renormalised sampling distribution after temperature, top-k, top-p and min-p.

    Written as the textbook procedure on a sorted list. Asserts that no probability lies within
    `margin` of a cut-off, so float32 rounding cannot decide membership.
    """
    p = softmax64(np.asarray(logits, np.float64) / temperature)
    order = sorted(range(len(p)), key=lambda i: -p[i])
    if top_k:
        order = order[:top_k]
    q = {i: p[i] for i in order}
    total = sum(q.values())
    q = {i: v / total for i, v in q.items()}
    if top_p < 1.0:
        kept, mass = [], 0.0
        for i in order:
            assert abs(mass - top_p) > margin, "top_p too close to a cumulative boundary"
            if mass < top_p:
                kept.append(i)
            mass += q[i]
        total = sum(q[i] for i in kept)
        q = {i: q[i] / total for i in kept}
    if min_p > 0.0:
        cut = min_p * max(q.values())
        for v in q.values():
            assert abs(v - cut) > margin * cut, "min_p too close to a probability"
        kept = [i for i in q if q[i] >= cut]
        total = sum(q[i] for i in kept)
        q = {i: q[i] / total for i in kept}
    out = np.zeros(len(p))
    for i, v in q.items():
        out[i] = v
    return out


def teacher_forced_logprobs(model, prompt_ids, prompt_mask, tokens, mask):
    """log p(token_t | prompt, tokens_<t) from one full forward pass (float64 log-softmax)."""
    full_ids = np.concatenate([prompt_ids, tokens], axis=1)
    full_mask = np.concatenate([prompt_mask, mask], axis=1)
    logits = np.asarray(model(full_ids, full_mask), np.float64)
    T = prompt_ids.shape[1]
    out = np.zeros(tokens.shape)
    for r in range(tokens.shape[0]):
        for t in range(tokens.shape[1]):
            if mask[r, t]:
                row = logits[r, T + t - 1]
                m = row.max()
                out[r, t] = row[tokens[r, t]] - (m + np.log(np.exp(row - m).sum()))
    return out


def tiny_lm(vocab: int, head_scale: float, seed: int = 0):
    """A 1-layer hfjax model with a sharp output head, so temperature and truncation matter."""
    cfg = ModelConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        tie_word_embeddings=False,
    )
    model = M.build(cfg, seed=seed)
    rng = np.random.default_rng(seed)
    head = rng.normal(0, head_scale / math.sqrt(32), (32, vocab)).astype(np.float32)
    model.lm_head.set_value(jnp.asarray(head))
    return model


def last_logits(model, ids, mask):
    return np.asarray(model(ids, mask))[:, -1]


# ---------------------------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def hf_pair(request, tmp_path_factory):
    """(kind, transformers model, hfjax model) with the same tiny random weights."""
    d = str(tmp_path_factory.mktemp(request.param))
    ref = make_hf_model(request.param, d)
    return request.param, ref, M.load(d)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("llama"))
    make_hf_model("llama", d)
    return M.load(d)


def hf_greedy(ref, ids, mask, max_new, eos=None):
    """transformers greedy continuation tokens [B, <= max_new] (pad 0 after EOS)."""
    ref.generation_config.eos_token_id = eos
    with torch.no_grad():
        out = ref.generate(
            input_ids=torch.tensor(ids, dtype=torch.long),
            attention_mask=torch.tensor(mask, dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_new,
            eos_token_id=eos,
            pad_token_id=0,
        )
    return out[:, ids.shape[1] :].numpy()


# ---------------------------------------------------------------------------------------------
# Greedy parity with HF
# ---------------------------------------------------------------------------------------------


def test_greedy_matches_hf(hf_pair):
    kind, ref, model = hf_pair
    ids, mask = left_padded_batch(ref.config.vocab_size, lengths=LENGTHS)
    want = hf_greedy(ref, ids, mask, 20)
    assert want.shape == (4, 20)
    out = generate(model, ids, mask, max_new_tokens=20, temperature=0.0, pad_id=0)
    np.testing.assert_array_equal(np.asarray(out.tokens), want, err_msg=kind)
    assert np.asarray(out.mask).all()

    # A stop token taken from the middle of row 0's continuation: both engines must cut there.
    stop = int(want[0, 7])
    want_stop = hf_greedy(ref, ids, mask, 20, eos=stop)
    out = generate(model, ids, mask, max_new_tokens=20, temperature=0.0, eos_ids=(stop,), pad_id=0)
    tokens, got_mask = np.asarray(out.tokens), np.asarray(out.mask)
    width = want_stop.shape[1]
    np.testing.assert_array_equal(tokens[:, :width], want_stop, err_msg=kind)
    assert (tokens[:, width:] == 0).all() and (got_mask[:, width:] == 0).all()
    for r in range(4):
        hits = np.flatnonzero(tokens[r] == stop)
        end = hits[0] + 1 if hits.size else 20
        np.testing.assert_array_equal(got_mask[r], np.arange(20) < end)


@pytest.fixture(scope="module")
def smollm2():
    """(hfjax model, transformers model, tokenizer) of SmolLM2-135M's first 2 layers, both from
    the same GGUF file. Greedy decoding runs the same code for every layer; full-depth logits
    against transformers are tests/models/test_smollm2.py's, and 30 layers make this test's
    programs compile for minutes."""
    import transformers

    from hfjax.models.smollm2 import smollm2_gguf_path

    path = smollm2_gguf_path()
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, num_hidden_layers=2
    ).eval()
    assert ref.config.num_hidden_layers == 2
    return M.load(str(path), max_layers=2), ref, M.load_tokenizer(path)


@pytest.mark.slow
def test_smollm2_greedy_matches_hf(smollm2):
    model, ref, tok = smollm2
    texts = [
        "The history of the printing press begins in the fifteenth century, when a goldsmith "
        "in Mainz combined movable metal type with an oil-based ink and a screw press adapted "
        "from the ones used to make wine. Within fifty years, presses had spread to",
        "def fibonacci(n):\n    # Return the n-th Fibonacci number using an iterative loop "
        "so that large n does not overflow the stack.\n    a, b = 0, 1\n    for _ in range(n):"
        "\n        a, b = b, a + b\n    return a\n\n\ndef factorial(n):\n",
        "Question: A train leaves the station at 3 pm travelling at 60 km per hour. A second "
        "train leaves the same station an hour later at 90 km per hour on a parallel track. At "
        "what time does the second train catch up with the first one? Answer:",
    ]
    rows = [tok.encode(t, add_special_tokens=False)[:32] for t in texts]
    assert all(len(r) == 32 for r in rows)
    ids = np.asarray(rows, np.int32)
    mask = np.ones_like(ids)
    want = hf_greedy(ref, ids, mask, 32)
    out = generate(model, ids, mask, max_new_tokens=32, temperature=0.0, pad_id=0)
    np.testing.assert_array_equal(np.asarray(out.tokens), want)


# ---------------------------------------------------------------------------------------------
# Log-probs
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "temperature, max_new",
    # 150 new tokens: a response longer than the prompts many times over, no stop ids.
    [(1.0, 12), (0.0, 12), (1.0, 150)],
)
def test_logprobs_match_teacher_forcing(llama, temperature, max_new):
    ids, mask = left_padded_batch(llama.config.vocab_size, lengths=LENGTHS, seed=1)
    n = 2
    out = generate(
        llama, ids, mask, max_new_tokens=max_new, temperature=temperature, n=n,
        eos_ids=(3, 9) if max_new < 100 else (), seed=5,
    )
    tokens, got_mask = np.asarray(out.tokens), np.asarray(out.mask)
    assert tokens.shape == (4 * n, max_new)
    want = teacher_forced_logprobs(
        llama, np.repeat(ids, n, 0), np.repeat(mask, n, 0), tokens, got_mask
    )
    got = np.asarray(out.logprobs)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert (got[got_mask == 0] == 0).all()


# ---------------------------------------------------------------------------------------------
# Sampling distribution and truncation
# ---------------------------------------------------------------------------------------------


def test_sampled_frequencies_follow_softmax():
    model = tiny_lm(vocab=8, head_scale=0.5)
    ids = np.asarray([[5, 1, 7, 2, 3]], np.int32)
    mask = np.ones_like(ids)
    T, N = 0.7, 6000
    out = generate(model, ids, mask, max_new_tokens=2, temperature=T, n=N, seed=123)
    tokens = np.asarray(out.tokens)

    # First token: drawn in the prefill program.
    p = softmax64(last_logits(model, ids, mask)[0] / T)
    counts = np.bincount(tokens[:, 0], minlength=8)
    stat, df = chi2_stat(counts, p)
    assert stat < chi2_quantile(df, Z_1E4), (stat, counts, p * N)
    # The test has power: the untempered softmax is rejected by a wide margin.
    wrong, _ = chi2_stat(counts, softmax64(last_logits(model, ids, mask)[0]))
    assert df == 7 and wrong > 5 * chi2_quantile(df, Z_1E4)

    # Second token, given the most frequent first token: drawn in the decode loop.
    first = int(np.argmax(counts))
    rows = tokens[:, 0] == first
    ctx = np.asarray([[5, 1, 7, 2, 3, first]], np.int32)
    p2 = softmax64(last_logits(model, ctx, np.ones_like(ctx))[0] / T)
    stat2, df2 = chi2_stat(np.bincount(tokens[rows, 1], minlength=8), p2)
    assert stat2 < chi2_quantile(df2, Z_1E4)


@pytest.mark.parametrize(
    "trunc",
    [
        dict(top_k=5),
        dict(top_p=0.55),
        dict(min_p=0.15),
        dict(top_k=12, top_p=0.8, min_p=0.05),
    ],
    ids=["top_k", "top_p", "min_p", "all"],
)
def test_truncation_is_exact(trunc):
    vocab, T, N = 32, 0.8, 3000
    model = tiny_lm(vocab=vocab, head_scale=1.0, seed=2)
    ids = np.asarray([[3, 14, 15, 9, 26, 5]], np.int32)
    mask = np.ones_like(ids)
    q = truncated_probs(last_logits(model, ids, mask)[0], T, **trunc)
    allowed = set(np.flatnonzero(q > 0).tolist())
    assert 1 < len(allowed) < vocab  # the truncation actually removes and keeps something

    out = generate(model, ids, mask, max_new_tokens=1, temperature=T, n=N, seed=7, **trunc)
    tokens = np.asarray(out.tokens)[:, 0]
    assert set(tokens.tolist()) <= allowed
    # The returned log-prob is that of the renormalised truncated distribution.
    np.testing.assert_allclose(np.asarray(out.logprobs)[:, 0], np.log(q[tokens]), atol=1e-5)
    stat, df = chi2_stat(np.bincount(tokens, minlength=vocab)[q > 0], q[q > 0])
    assert stat < chi2_quantile(max(df, 1), Z_1E4)


# ---------------------------------------------------------------------------------------------
# Seeds, buckets, stops
# ---------------------------------------------------------------------------------------------


def test_row_samples_do_not_depend_on_batch(llama):
    ids, mask = left_padded_batch(llama.config.vocab_size, lengths=LENGTHS, seed=2)
    kw = dict(max_new_tokens=8, temperature=1.0, n=3)
    both = generate(llama, ids, mask, seed=np.array([11, 22, 33, 44]), **kw)
    alone = generate(llama, ids[2:3], mask[2:3], seed=np.array([33]), **kw)
    np.testing.assert_array_equal(np.asarray(both.tokens)[6:9], np.asarray(alone.tokens))
    np.testing.assert_allclose(np.asarray(both.logprobs)[6:9], np.asarray(alone.logprobs), 1e-6)
    # The n samples of one prompt differ from each other, and an int seed is reproducible.
    t = np.asarray(both.tokens)
    assert not (t[0] == t[1]).all() and not (t[1] == t[2]).all()
    a = generate(llama, ids, mask, seed=9, **kw)
    b = generate(llama, ids, mask, seed=9, **kw)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    assert not np.array_equal(np.asarray(a.tokens), t)


def test_buckets_compile_once_and_do_not_change_results(llama):
    sampler = Sampler(llama)
    _, state = nnx.split(llama)
    vocab = llama.config.vocab_size
    ids9, mask9 = left_padded_batch(vocab, lengths=(9, 5, 3, 2), seed=3)
    ids12, mask12 = left_padded_batch(vocab, lengths=(12, 5, 11, 1), seed=3)
    short = sampler.generate(state, ids9, mask9, SamplingParams(5, temperature=1.0), seed=4)
    long = sampler.generate(state, ids9, mask9, SamplingParams(13, temperature=1.0), seed=4)
    sampler.generate(state, ids12, mask12, SamplingParams(16, temperature=1.0), seed=4)
    assert len(sampler.compile_log) == 1  # prompts <= 16 tokens, <= 16 new tokens: one bucket
    assert short.tokens.shape == (4, 5) and long.tokens.shape == (4, 13)
    np.testing.assert_array_equal(np.asarray(short.tokens), np.asarray(long.tokens)[:, :5])
    # Extra left padding in the input does not change anything either.
    wide_ids = np.pad(ids9, ((0, 0), (7, 0)))
    wide_mask = np.pad(mask9, ((0, 0), (7, 0)))
    wide = sampler.generate(state, wide_ids, wide_mask, SamplingParams(5, temperature=1.0), seed=4)
    np.testing.assert_array_equal(np.asarray(wide.tokens), np.asarray(short.tokens))
    assert len(sampler.compile_log) == 1
    ids17 = np.pad(ids12, ((0, 0), (5, 0)), constant_values=1)
    sampler.generate(state, ids17, np.ones_like(ids17), SamplingParams(17, temperature=1.0))
    # 17 prompt tokens take the 24-column prompt bucket; 17 new tokens the 32-token one.
    assert [(s.prompt_bucket, s.new_bucket) for s in sampler.compile_log] == [(16, 16), (24, 32)]


def test_bucket_sizes():
    lengths = (0, 1, 16, 17, 24, 25, 33, 49, 65, 97, 129, 164, 193, 300)
    assert [bucket_size(n, 16, fine=True) for n in lengths] == \
        [16, 16, 16, 24, 24, 32, 48, 64, 96, 128, 192, 192, 256, 384]
    assert [bucket_size(n, 16) for n in lengths] == \
        [16, 16, 16, 32, 32, 32, 64, 64, 128, 128, 256, 256, 256, 512]
    assert bucket_size(300, 16, 256, fine=True) == 256 and bucket_size(3, 1, fine=True) == 3


def test_stop_ids_end_rows(llama):
    ids, mask = left_padded_batch(llama.config.vocab_size, lengths=LENGTHS, seed=4)
    free = generate(llama, ids, mask, max_new_tokens=16, temperature=1.0, n=4, seed=1)
    t = np.asarray(free.tokens)
    stops = (int(t[0, 3]), int(t[5, 6]))  # ids that do occur in the unconstrained samples
    out = generate(
        llama, ids, mask, max_new_tokens=16, temperature=1.0, n=4, seed=1, eos_ids=stops, pad_id=0
    )
    tokens, m, lp = (np.asarray(x) for x in out[:3])
    ended = 0
    for r in range(tokens.shape[0]):
        hits = np.flatnonzero(np.isin(t[r], stops))
        end = hits[0] + 1 if hits.size else 16
        ended += bool(hits.size)
        # Same seed: identical up to and including the stop token, then pad with mask 0.
        np.testing.assert_array_equal(tokens[r, :end], t[r, :end])
        assert (m[r, :end] == 1).all() and (m[r, end:] == 0).all()
        assert (tokens[r, end:] == 0).all() and (lp[r, end:] == 0).all()
    assert ended >= 2


# ---------------------------------------------------------------------------------------------
# Sharded decoding
# ---------------------------------------------------------------------------------------------


def test_sharded_output_equals_single_device(llama):
    ids, mask = left_padded_batch(llama.config.vocab_size, lengths=(9, 5, 12, 1, 7, 3), seed=5)
    kw = dict(max_new_tokens=10, temperature=0.9, top_k=40, top_p=0.95, n=2, eos_ids=(7,))
    one = generate(llama, ids, mask, seed=3, **kw)
    mesh = MeshSpec.parse("data=4,tensor=2").build(jax.devices())
    sampler = Sampler(llama, mesh=mesh)
    _, state = nnx.split(llama)
    placed = sampler.place(state)
    q = placed["model"]["layers"]["q_proj"].get_value()
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, None, "tensor")
    # 6 prompts on a data axis of 4: padded to 8 prompts inside, 12 rows out.
    params = SamplingParams(**kw)
    eight = sampler.generate(placed, ids, mask, params, seed=3)
    assert eight.tokens.shape == (12, 10)
    assert sampler.compile_log[0].batch == 8
    np.testing.assert_array_equal(np.asarray(eight.tokens), np.asarray(one.tokens))
    np.testing.assert_array_equal(np.asarray(eight.mask), np.asarray(one.mask))
    np.testing.assert_allclose(np.asarray(eight.logprobs), np.asarray(one.logprobs), atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=-3), "max_new_tokens"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(min_p=1.0), "min_p"),
        (dict(min_p=-0.1), "min_p"),
        (dict(temperature=-1.0), "temperature"),
        (dict(n=0), "n="),
    ],
)
def test_bad_sampling_params(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**{"max_new_tokens": 4, **kw})


def test_bad_prompts(llama):
    sampler = Sampler(llama, max_prompt_len=16)
    _, state = nnx.split(llama)
    params = SamplingParams(4)
    ids, mask = left_padded_batch(llama.config.vocab_size, lengths=(17, 3), seed=6)
    with pytest.raises(ValueError, match="max_prompt_len=16"):
        sampler.generate(state, ids, mask, params)
    ids, mask = left_padded_batch(llama.config.vocab_size, lengths=(5, 3), seed=6)
    with pytest.raises(ValueError, match="left-padded"):
        sampler.generate(state, ids, mask[:, ::-1], params)
    with pytest.raises(ValueError, match="attention_mask"):
        sampler.generate(state, ids, mask[:, 1:], params)
    with pytest.raises(ValueError, match="one seed per prompt"):
        sampler.generate(state, ids, mask, params, seed=[1, 2, 3])
    with pytest.raises(ValueError, match="empty"):
        sampler.generate(state, ids, np.zeros_like(mask), params)
    assert sampler.compile_log == []  # every error came before compiling


def test_bf16_decode_cache_and_logprobs(tmp_path):
    """bfloat16 compute: on CPU the decode cache is kept in float32 (a bfloat16 one would be
    copied whole at every step's write, `transformer.storage_dtype`), the prefill's cache too,
    and the sampled tokens' log-probs match a bfloat16 teacher-forced pass within bfloat16
    rounding."""
    from hfjax.models import transformer

    on_cpu = jax.default_backend() == "cpu"
    assert transformer.storage_dtype(jnp.bfloat16) == (jnp.float32 if on_cpu else jnp.bfloat16)
    assert transformer.storage_dtype(jnp.bfloat16, "cpu") == jnp.float32
    assert transformer.storage_dtype(jnp.bfloat16, "gpu") == jnp.bfloat16
    assert transformer.storage_dtype(jnp.float32, "cpu") == jnp.float32
    make_hf_model("llama", str(tmp_path))
    model = M.load(str(tmp_path), dtype="bfloat16", param_dtype="float32")
    prefill = transformer.KVCache.zeros(model.config, 2, 8)
    assert prefill.k.dtype == transformer.storage_dtype(jnp.bfloat16)
    ids, mask = left_padded_batch(model.config.vocab_size, lengths=LENGTHS, seed=1)
    out = generate(model, ids, mask, max_new_tokens=12, temperature=1.0, n=2, eos_ids=(3, 9),
                   seed=5)
    tokens, got_mask = np.asarray(out.tokens), np.asarray(out.mask)
    want = teacher_forced_logprobs(model, np.repeat(ids, 2, 0), np.repeat(mask, 2, 0), tokens,
                                   got_mask)
    got = np.asarray(out.logprobs)
    assert got_mask.sum() > 40
    err = np.abs(got - want)[got_mask == 1]
    assert err.max() < 0.05, err.max()
    # Not the float32 model's numbers: the test runs in bfloat16.
    ref = M.load(str(tmp_path))
    f32 = teacher_forced_logprobs(ref, np.repeat(ids, 2, 0), np.repeat(mask, 2, 0), tokens,
                                  got_mask)
    assert np.abs(f32 - want)[got_mask == 1].max() > 1e-4


def test_blocked_inverse_cdf_draws_the_tokens_of_the_plain_one():
    """The accelerators' two-level draw (`blocked_inverse_cdf`) against a loop over each row's
    running sum in float64: the same token wherever the draw is not within rounding of a
    boundary, and never a zero-probability token (zeros inside blocks, whole empty blocks, an
    empty tail, and blocks that do not divide the vocabulary)."""
    from hfjax.engine.token_select import blocked_inverse_cdf

    rng = np.random.default_rng(0)
    R, V = 64, 203
    probs = rng.random((R, V)).astype(np.float32) ** 4
    probs[rng.random((R, V)) < 0.3] = 0.0
    probs[:8, 16:48] = 0.0  # empty blocks at block size 16
    probs[8:16, 150:] = 0.0  # empty tail
    probs /= probs.sum(-1, keepdims=True)
    u = np.concatenate([rng.random(R - 2), [0.0, 1.0 - 1e-7]]).astype(np.float32)
    for block in (16, 64, 1024):
        got = np.asarray(jax.jit(blocked_inverse_cdf, static_argnums=2)(
            jnp.asarray(probs), jnp.asarray(u), block))
        for r in range(R):
            assert probs[r, got[r]] > 0, (block, r)
            total, target, want = 0.0, float(u[r]) * float(probs[r].astype(np.float64).sum()), V
            for i in range(V):
                total += float(probs[r, i])
                if total > target:
                    want = i
                    break
            running = np.cumsum(probs[r].astype(np.float64))
            if np.min(np.abs(running - target)) > 1e-5:
                assert got[r] == want, (block, r, got[r], want)


def test_truncated_marks_responses_cut_off_without_a_stop_token():
    """Rows of 4 columns, stop tokens 2 and 7: full rows whose last token is no stop token are
    truncated; a full row ending on a stop token and shorter rows are not; with no stop
    tokens every full row is."""
    from hfjax.engine.token_select import truncated

    pad = 0
    rows = [([5, 6, 5, 6], 4), ([5, 6, 5, 2], 4), ([5, 7, pad, pad], 2), ([5, 6, 5, 7], 4),
            ([pad] * 4, 0), ([3, 3, 3, 3], 4)]
    tokens = jnp.asarray([t for t, _ in rows], jnp.int32)
    mask = jnp.asarray([[1] * n + [0] * (4 - n) for _, n in rows], jnp.int32)

    def want(eos, limit):  # loop-based reference
        return [int(n >= limit and (n == 0 or t[n - 1] not in eos)) for t, n in rows]

    for eos, limit in (((2, 7), 4), ((), 4), ((2, 7), 8)):
        np.testing.assert_array_equal(truncated(tokens, mask, limit, eos), want(eos, limit))


def test_inverse_cdf_edges_never_draw_a_zero_probability_token():
    """The draws at u = 0 and at the largest float32 below 1, with zero-probability tokens
    first and last (a few, and whole blocks of the blocked draw): the first and the last token
    with mass, for the plain and the blocked draw. A strict `cdf < target` would pick a leading
    zero at u = 0."""
    from hfjax.engine.token_select import blocked_inverse_cdf, inverse_cdf

    V = 40
    probs = np.zeros((3, V), np.float32)
    probs[0, 3:37] = 1.0  # three zeros first, three last
    probs[1, 16:20] = [0.1, 0.2, 0.3, 0.4]  # a whole empty block first and behind (block 8)
    probs[2, 9] = 1.0  # one token with mass
    probs /= probs.sum(-1, keepdims=True)
    first, last = [3, 16, 9], [36, 19, 9]
    below_one = np.nextafter(np.float32(1), np.float32(0))
    draws = {"plain": jax.jit(inverse_cdf),
             "blocked": jax.jit(lambda p, u: blocked_inverse_cdf(p, u, 8))}
    for name, draw in draws.items():
        for u, want in ((np.float32(0), first), (below_one, last)):
            got = np.asarray(draw(jnp.asarray(probs), jnp.full((3,), u)))
            assert got.tolist() == want, (name, float(u), got)

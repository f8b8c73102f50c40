"""Continuous batching against the static engine: same tokens, masks and log-probs row for row.

The reference is the static `Sampler`, itself tested against HF transformers and teacher-forced
log-probs (test_sampler.py). Every comparison here is set up so that it can fail: responses
end at different steps (stop ids that the model does emit), there are more requests than slots
so slots are refilled, and the sampled rows differ between seeds.
"""

import os
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from ml_collections import config_dict

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
from hf_fixtures import left_padded_batch, make_hf_model  # noqa: E402
from support import rollout_spec  # noqa: E402

import hfjax.models as M  # noqa: E402
from hfjax.engine import Sampler, SamplingParams  # noqa: E402
from hfjax.engine.continuous import ContinuousSampler, rollout_sampler  # noqa: E402
from hfjax.engine.decode import DecodeOptions  # noqa: E402
from hfjax.parallel.mesh import MeshSpec  # noqa: E402

LENGTHS = (9, 5, 12, 1, 7, 3)
SEEDS = np.array([3, 14, 15, 92, 65, 35])


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("llama"))
    make_hf_model("llama", d)
    return M.load(d)


@pytest.fixture(scope="module")
def prompts(llama):
    return left_padded_batch(llama.config.vocab_size, lengths=LENGTHS, seed=5)


@pytest.fixture(scope="module")
def static(llama):
    """The reference engine, shared so that its programs compile once per module."""
    return Sampler(llama)


SAMPLING = {
    "greedy": dict(temperature=0.0),
    "seeded": dict(temperature=0.9, top_k=40, top_p=0.95),
}
MAX_NEW = 20


@pytest.fixture(scope="module")
def reference(llama, prompts, static):
    """kind -> (SamplingParams, the static engine's output), computed once per module.

    The stop ids are two ids the unconstrained run emits, chosen so that responses end at as
    many different steps as possible while some still run to max_new_tokens.
    """
    cache = {}

    def get(kind, max_new=MAX_NEW):
        if (kind, max_new) not in cache:
            free = SamplingParams(max_new_tokens=max_new, n=3, **SAMPLING[kind])
            t = np.asarray(static.generate(nnx.state(llama), *prompts, free, SEEDS).tokens)

            def lengths(stops):
                hit = np.isin(t, stops)
                return np.where(hit.any(axis=1), hit.argmax(axis=1) + 1, max_new)

            candidates = sorted(set(t[:, : max_new // 2].ravel().tolist()))
            stops = max(
                [(a, b) for a in candidates for b in candidates if a < b],
                key=lambda p: (lengths(p).max() == max_new, len(set(lengths(p).tolist()))),
            )
            params = SamplingParams(**{**vars(free), "eos_ids": stops})
            out = static.generate(nnx.state(llama), *prompts, params, SEEDS)
            cache[kind, max_new] = params, out
        return cache[kind, max_new]

    return get


def mesh_of(spec):
    return None if spec is None else MeshSpec.parse(spec).build(jax.devices())


def assert_same(got, want):
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_array_equal(np.asarray(got.mask), np.asarray(want.mask))
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs), atol=1e-5)


CASES = [
    # (mesh, slots, refill_every, prefill_batch, min_slots): refill only, refill and drain,
    # drain only (one slot per request), on 1 device and on data=4,tensor=2
    (None, 4, 1, None, 40),
    (None, 5, 3, 1, 2),
    ("data=4,tensor=2", 4, 2, None, 40),
    ("data=4,tensor=2", 0, 3, 4, 4),
]
IDS = ["1dev-refill", "1dev-refill-drain-g1", "dp4tp2-refill", "dp4tp2-drain-g4"]


@pytest.mark.parametrize("mesh, slots, k, g, least", CASES, ids=IDS)
@pytest.mark.parametrize("kind", list(SAMPLING))
def test_outputs_equal_the_static_engine(llama, prompts, reference, mesh, slots, k, g, least, kind):
    params, want = reference(kind)
    lengths = np.asarray(want.mask).sum(axis=1)
    # The comparison has power: rows stop at different steps.
    assert len(set(lengths.tolist())) >= 3 and lengths.max() == MAX_NEW

    engine = ContinuousSampler(
        llama, mesh=mesh_of(mesh), slots=slots, refill_every=k, prefill_batch=g, min_slots=least
    )
    got = engine.generate(engine.place(nnx.state(llama)), *prompts, params, SEEDS)
    assert got.tokens.shape == want.tokens.shape == (18, MAX_NEW)
    assert_same(got, want)

    plan, stats = engine.compile_log[-1], {k: int(v) for k, v in engine.last_stats.items()}
    # 18 requests (24 with the data-parallel padding of 6 prompts to 8) through fewer slots,
    # or drained into fewer: less work than the static engine's rows x steps.
    assert plan.slots < plan.prompts * 3 or plan.drain
    assert stats["slot_steps"] < plan.prompts * 3 * MAX_NEW
    assert stats["decode_steps"] >= MAX_NEW - 1  # token 0 comes from the prefill
    # The samples of a prompt shared its prefill: one window per prefill_batch prompts (the
    # last window may overlap the one before).
    assert stats["prefill_windows"] == -(-plan.prompts // plan.prefill_batch)
    if g == 1:
        assert stats["prefill_windows"] == 6


def test_long_responses_equal_the_static_engine(llama, prompts, reference):
    """Responses of up to 150 tokens through 4 slots refilled as requests stop: slots decode at
    columns far apart (one response column written per slot per step), over many refills."""
    params, want = reference("seeded", 150)
    lengths = np.asarray(want.mask).sum(axis=1)
    assert lengths.max() == 150 and (lengths <= 64).any() and len(set(lengths.tolist())) >= 4
    engine = ContinuousSampler(llama, slots=4, refill_every=2)
    got = engine.generate(nnx.state(llama), *prompts, params, SEEDS)
    assert_same(got, want)


def test_seeds_and_slots_decide_nothing_but_the_seeded_rows(llama, prompts):
    """A request's samples depend on its own seed only: not on the slot count, the refill
    interval or the other requests; a different seed changes them."""
    params = SamplingParams(max_new_tokens=12, temperature=1.0, n=2)
    state = nnx.state(llama)
    three = ContinuousSampler(llama, slots=3, refill_every=1)
    a = three.generate(state, *prompts, params, SEEDS)
    b = ContinuousSampler(llama, slots=0, refill_every=4, min_slots=1).generate(
        state, *prompts, params, SEEDS
    )
    assert_same(a, b)
    alone = three.generate(state, prompts[0][2:3], prompts[1][2:3], params, SEEDS[2:3])
    assert_same(alone, type(a)(*(x[4:6] for x in a[:3])))
    other = three.generate(state, *prompts, params, SEEDS + 1)
    assert not np.array_equal(np.asarray(other.tokens), np.asarray(a.tokens))
    t = np.asarray(a.tokens)
    assert not np.array_equal(t[0], t[1])  # two samples of one prompt differ


def test_short_and_odd_budgets(llama, prompts, static):
    engine = ContinuousSampler(llama, slots=4, refill_every=2)
    for max_new in (1, 2, 17):
        params = SamplingParams(max_new_tokens=max_new, temperature=1.0, n=2, eos_ids=(5,))
        want = static.generate(nnx.state(llama), *prompts, params, 7)
        got = engine.generate(nnx.state(llama), *prompts, params, 7)
        assert got.tokens.shape == (12, max_new)
        assert_same(got, want)
    # max_new_tokens is traced: 1 and 2 share the 16-token bucket's program.
    assert [p.new_bucket for p in engine.compile_log] == [16, 32]


@pytest.mark.slow
def test_smollm2_samples_equal_the_static_engine():
    """Real weights, temperature 1: bit-identical rows, as long as both engines decode with 33
    or more rows. XLA:CPU rounds a row of SmolLM2's projections differently below that (the
    matmul kernels depend on the row count; docs/benchmarks.md), so 40 slots against the
    static engine's 48 rows is the smallest setting this can hold for. The rounding is a
    matter of the projections' shapes, not of depth: the model is SmolLM2's first 2 layers
    (its 30 make the two engines' programs compile for minutes)."""
    from hfjax.models.smollm2 import smollm2_gguf_path

    path = smollm2_gguf_path()
    model, tok = M.load(str(path), max_layers=2), M.load_tokenizer(path)
    texts = [
        "Write a short poem about the sea.",
        "What is 17 times 23? Answer briefly.",
        "Name three colours.",
        "Explain what a prime number is in one sentence.",
        "Say hello.",
        "List the days of the week.",
    ]
    rows = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=True) for t in texts]
    width = max(map(len, rows))
    ids = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = r
    mask = np.arange(width)[None, :] >= width - np.array([len(r) for r in rows])[:, None]
    params = SamplingParams(max_new_tokens=24, temperature=1.0, n=8, eos_ids=(tok.eos_id, 30))
    state = nnx.state(model)
    want = Sampler(model).generate(state, ids, mask.astype(np.int32), params, SEEDS)
    engine = ContinuousSampler(model, slots=40, refill_every=4)
    got = engine.generate(state, ids, mask.astype(np.int32), params, SEEDS)
    lengths = np.asarray(want.mask).sum(axis=1)
    assert lengths.min() < 24 and lengths.max() == 24  # rows stop at different steps
    # A window fills the 40 slots: ceil(40 / 8) = 5 prompts, so the 6 prompts take 2 windows.
    assert int(engine.last_stats["prefill_windows"]) == 2
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_array_equal(np.asarray(got.logprobs), np.asarray(want.logprobs))


# ---------------------------------------------------------------------------------------------
# Through the actor, on the 3D-HybridEngine's decode mesh
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_actor_generates_the_same_through_continuous_batching():
    from support import tiny_rl_config

    from hfjax.data.batching import prompt_batch
    from hfjax.run.trainer import Trainer

    trainers = {}
    for mode in ("static", "continuous"):
        c = tiny_rl_config(mesh="fsdp=4,tensor=2")  # TRAIN_RULES nest under the decode mesh
        c.rollout.mesh, c.rollout.hybrid_engine = "data=4,tensor=2", True
        c.rollout.mode, c.rollout.slots, c.rollout.refill_every = mode, 8, 2
        c.rollout.n, c.rollout.response_length = 2, 12
        trainers[mode] = Trainer(c)
    cont = trainers["continuous"]
    assert isinstance(cont.actor.sampler, ContinuousSampler)
    assert not isinstance(trainers["static"].actor.sampler, ContinuousSampler)
    assert cont.actor.sampler.mesh == cont.actor.hybrid.decode_mesh
    rows = cont.test_data.rows
    seeds = np.arange(len(rows), dtype=np.int32) * 7 + 1
    for greedy in (True, False):
        out = {
            mode: t.actor.generate(
                prompt_batch(rows, seeds, t.tok.pad_id, t.cfg.data.max_prompt_length),
                greedy=greedy,
            )
            for mode, t in trainers.items()
        }
        for key in ("responses", "response_mask", "input_ids"):
            np.testing.assert_array_equal(
                np.asarray(out["continuous"][key]), np.asarray(out["static"][key])
            )
        np.testing.assert_allclose(
            np.asarray(out["continuous"]["rollout_log_probs"]),
            np.asarray(out["static"]["rollout_log_probs"]),
            atol=1e-5,
        )
    assert len(rows) * 2 > 8  # more samples than slots: the actor's rollout refilled them
    metrics = cont.train_step()
    assert np.isfinite(metrics["actor/pg_loss"])


# ---------------------------------------------------------------------------------------------
# Bad input: clear errors before anything compiles
# ---------------------------------------------------------------------------------------------


def test_request_longer_than_the_slot_cache_is_refused(llama, prompts, static):
    engine = ContinuousSampler(llama, slots=4, max_cache_len=24)
    state = nnx.state(llama)
    # The longest prompt has 12 tokens: 12 + 13 = 25 columns > 24.
    with pytest.raises(ValueError, match=r"12 prompt \+ 13 new tokens = 25.*max_cache_len=24"):
        engine.generate(state, *prompts, SamplingParams(13), 0)
    assert engine.compile_log == []
    # 12 + 12 fits: the buckets (16 + 16) shrink to the cache, with the same tokens.
    params = SamplingParams(12, temperature=1.0, eos_ids=(5,))
    got = engine.generate(state, *prompts, params, 0)
    plan = engine.compile_log[-1]
    assert plan.columns <= 24 and plan.prompt_bucket >= 12 and plan.new_bucket >= 12
    want = static.generate(state, *prompts, params, 0)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))


@pytest.mark.parametrize("max_new", [0, -2])
def test_max_new_tokens_must_be_positive(max_new):
    with pytest.raises(ValueError, match=f"max_new_tokens={max_new}; it must be a positive"):
        SamplingParams(max_new_tokens=max_new)
    # A training run with continuous batching is refused with its config, before building.
    from configs import ppo_arith
    from hfjax.run.trainer import validate_config

    c = ppo_arith.get_config()
    c.rollout.mode, c.rollout.response_length = "continuous", max_new
    with pytest.raises(ValueError, match=f"rollout.response_length={max_new}: needs an int >= 1"):
        validate_config(c)


@pytest.mark.parametrize(
    "kw, mesh, match",
    [
        (dict(slots=-1), None, "slots=-1; it must be an int >= 0"),
        (dict(min_slots=-1), None, "min_slots=-1; it must be an int >= 0"),
        (dict(slots=6), "data=4,tensor=2", r"slots=6 does not divide .* multiple of 4"),
        (dict(refill_every=0), None, "refill_every=0"),
        (dict(prefill_batch=0), None, "prefill_batch=0"),
        (dict(max_cache_len=1), None, "max_cache_len=1"),
    ],
)
def test_bad_settings(llama, kw, mesh, match):
    with pytest.raises(ValueError, match=match):
        ContinuousSampler(llama, mesh=mesh_of(mesh), **kw)


def test_config_selects_the_engine(llama):
    cfg = dict(mode="static", slots=4, refill_every=2, max_cache_len=0)
    assert type(rollout_sampler(llama, rollout_spec(**cfg))) is Sampler
    cfg["mode"] = "continuous"
    engine = rollout_sampler(llama, rollout_spec(**cfg))
    assert isinstance(engine, ContinuousSampler)
    assert (engine.slots, engine.refill_every, engine.max_cache_len) == (4, 2, None)
    cfg["mode"] = "paged"
    with pytest.raises(ValueError, match="rollout.mode='paged'; choose one of static, continuous"):
        rollout_sampler(llama, rollout_spec(**cfg))
    cfg["mode"], cfg["slots"] = "continuous", 6
    with pytest.raises(ValueError, match=r"rollout \(mode=continuous\): slots=6 .*multiple of 4"):
        rollout_sampler(llama, rollout_spec(**cfg), mesh=mesh_of("data=4,tensor=2"))


def test_the_engine_takes_the_spec_not_a_config_section(llama):
    section = config_dict.ConfigDict(dict(mode="static"))
    with pytest.raises(TypeError, match=r"rollout_sampler: rollout= is a ConfigDict, not the "
                                        r"RolloutSpec it needs; build it once with "
                                        r"RolloutSpec\.of\(cfg\.rollout\)"):
        rollout_sampler(llama, section)


def test_drain_stays_in_its_row_range(llama):
    """The drain shrinks by 3/4 down to the start of the row range the slots are in
    (ROW_RANGES), so its rows keep the rounding of a static batch in that range; in at most
    MAX_DRAIN_PHASES (3) even steps where 3/4 steps would take more (each phase compiles a
    decode step of its own)."""
    engine = ContinuousSampler(llama)  # slots=0: one per request; min_slots=0: automatic
    params = SamplingParams(8, n=8)
    assert engine._plan(16, 16, 16, params).drain == (82, 52, 33)  # 3/4: 96, 72, 54, 41, 33
    assert engine._plan(4, 16, 16, params).drain == (21, 13, 8)  # 3/4: 24, 18, 14, 11, 9, 8
    assert engine._plan(3, 16, 16, SamplingParams(8, n=2)).drain == ()  # 6 rows: below 8
    assert ContinuousSampler(llama, slots=64, min_slots=50)._plan(16, 16, 16, params).drain == (50,)
    on_mesh = ContinuousSampler(llama, mesh=mesh_of("data=4,tensor=2"), slots=64)
    assert on_mesh._plan(16, 16, 16, params).drain == (48, 36)


@pytest.mark.parametrize("opts", [DecodeOptions("chunked", "gpu", 5),
                                  DecodeOptions("pallas", "gpu", interpret=True)],
                         ids=["chunked-gpu", "pallas-gpu"])
def test_decode_variants_equal_the_cpu_read(llama, prompts, reference, opts):
    """Both engines reading the cache another way (`hfjax.engine.decode.DecodeOptions`: the
    chunked read with a short last chunk, the Pallas kernel in interpret mode, both on the
    GPU layout) give the CPU full read's greedy tokens and log-probs; the continuous engine's
    slots sit at different columns."""
    params, want = reference("greedy")
    for engine in (Sampler(llama, decode=opts),
                   ContinuousSampler(llama, slots=4, refill_every=1, decode=opts)):
        got = engine.generate(nnx.state(llama), *prompts, params, SEEDS)
        assert_same(got, want)


def test_config_selects_the_decode_read(llama):
    for mode in ("static", "continuous"):
        rollout = rollout_spec(mode=mode, decode_attention="chunked", kv_layout="gpu")
        assert rollout_sampler(llama, rollout).decode[:2] == ("chunked", "gpu")
        # auto on these CPU devices: today's full read and layout.
        auto = rollout_sampler(llama, rollout_spec(mode=mode))
        assert auto.decode == DecodeOptions("full", "cpu")
    bad = rollout_spec(mode="static", decode_attention="pallas", kv_layout="cpu")
    with pytest.raises(ValueError, match="kv_layout=gpu"):
        rollout_sampler(llama, bad)

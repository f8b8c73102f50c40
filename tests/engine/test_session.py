"""Turns that keep their cache (hfjax.engine.session, through hfjax.agents.AgentLoop): every
later turn equals what the static engine draws when the row's whole context is prefilled again
with the turn's seed (tokens exactly, log-probs to float tolerance), on forced 3-turn
trajectories and on sampled ones; the first turn is the single-turn engine's; only the tool's
result (and the turn's last token) is prefilled; the same trajectories come out of a
data-parallel decode mesh of the hybrid engine and of the "gpu" cache layout."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx
from support import python_isolation, scripted_policy, tool_call_successors

from configs import ppo_arith
from hfjax.agents import AgentLoop
from hfjax.agents.loop import _turn_seed
from hfjax.data import tool_arith
from hfjax.data.batching import left_pad
from hfjax.engine.decode import DecodeOptions
from hfjax.engine.hybrid import HybridEngine
from hfjax.engine.sampler import Sampler, SamplingParams
from hfjax.engine.session import TurnEngine
from hfjax.engine.spec import MultiTurnSpec
from hfjax.models import transformer
from hfjax.models.config import ModelConfig
from hfjax.parallel import sharding as shd
from hfjax.parallel.mesh import MeshSpec
from hfjax.tools import ToolRunner, resolve_tools

TOK = tool_arith.tokenizer()
P, R, N = 16, 48, 2  # prompt columns, response budget, samples per prompt
# One unused id past the tokenizer's: a vocabulary the decode mesh's tensor axis divides.
CFG = ModelConfig(vocab_size=TOK.vocab_size + 1, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=False,
                  max_position_embeddings=P + R, pad_token_id=TOK.pad_id,
                  eos_token_id=TOK.eos_id)
PROBLEMS = ["123*456=", "9876*54=", "31*2=", "4444*1234="]
SEEDS = np.array([3, 4, 5, 6])
OPEN, CLOSE = (TOK.encode(t, add_special_tokens=False)[0] for t in ("<tool_call>", "</tool_call>"))


def _policy(scale: float, mix: float, seed: int = 5, chain: bool = False):
    """The arith_tool tiny model scripted to call its tool after the prompt and after every
    result (`scripted_policy`), with `mix` times its random attention output projections put
    back: its logits then depend on the cache (the script alone reads only the current token).
    With a small `scale` a temperature-1 draw often leaves the script. With `chain`, a call is
    followed by another call instead of the end of the turn."""
    model = transformer.build(CFG, "causal_lm", seed=seed)
    o_proj = np.asarray(model.model.layers.o_proj[...])
    successors = tool_call_successors(TOK, "<tool_call>")
    if chain:
        successors[CLOSE] = successors[TOK.eos_id] = OPEN
    scripted_policy(model, successors, scale=scale)
    model.model.layers.o_proj[...] = mix * o_proj
    return model


@pytest.fixture(scope="module")
def forced():
    return _policy(40.0, 1.0)


@pytest.fixture(scope="module")
def noisy():
    return _policy(6.0, 1.0)


@pytest.fixture(scope="module")
def runner():
    tools = resolve_tools("support:AnswerTool,python",
                          {"python": {"isolation": python_isolation()}})
    with ToolRunner(tools, max_workers=4) as r:
        yield r


def _prompts():
    ids, mask = left_pad([TOK.encode(p, add_special_tokens=False) for p in PROBLEMS], P,
                         TOK.pad_id)
    return np.asarray(ids), np.asarray(mask)


def _loop(sampler, runner, calls=1):
    base = MultiTurnSpec.of(ppo_arith.get_config().rollout.multi_turn)
    spec = dataclasses.replace(base, enable=True, tools="support:AnswerTool,python",
                               max_turns=3, max_tool_response_len=8, max_parallel_calls=calls)
    return AgentLoop(sampler, TOK, runner, spec)


def _params(**kw):
    return SamplingParams(**{"max_new_tokens": R, "temperature": 1.0, "n": N,
                             "eos_ids": (TOK.eos_id,), **kw})


def _run(sampler, runner, state, calls=1):
    loop = _loop(sampler, runner, calls)
    ids, mask = _prompts()
    out = loop.run(state, ids, mask, _params(), seed=SEEDS)
    return loop, out


def _turns(traj):
    """(start column, tokens, policy turn index) of each policy turn."""
    at, k, found = 0, 0, []
    for turn in traj.turns:
        if turn["role"] == "assistant":
            found.append((at, turn["tokens"], k))
            k += 1
        at += turn["tokens"]
    return found


def _check_against_reprefill(model, loop, out):
    """Every later policy turn equals the static engine's draw for the row's context so far,
    re-prefilled, with the turn's seed; the first turn equals the single-turn engine's.
    Returns the number of later turns checked."""
    ids, mask = _prompts()
    state = nnx.state(model)
    # With one call per turn the close tag stops a turn; with more the loop cuts it after.
    stops = (TOK.eos_id,) + ((loop.close_id,) if loop.spec.max_parallel_calls == 1 else ())
    single = Sampler(model, max_prompt_len=P, pad_id=TOK.pad_id)
    first = single.generate(state, ids, mask, _params(eos_ids=stops), seed=SEEDS)
    reprefill = Sampler(model, max_prompt_len=P + R, pad_id=TOK.pad_id)
    later = {}  # turn index -> [(row, start, length)]
    for r, traj in enumerate(out.trajectories):
        for at, n, k in _turns(traj):
            if k == 0:
                want = np.asarray(first.tokens)[r][:n]
                np.testing.assert_array_equal(out.tokens[r, :n], want)
                np.testing.assert_allclose(out.logprobs[r, :n],
                                           np.asarray(first.logprobs)[r][:n], atol=1e-5)
            else:
                later.setdefault(k, []).append((r, at, n))
    checked = 0
    for k, turns in sorted(later.items()):
        # One re-prefill per turn index, every row's context a prompt of its own seed.
        contexts = [list(ids[r // N][mask[r // N] > 0]) + list(out.tokens[r, :at])
                    for r, at, _ in turns]
        cids, cmask = left_pad(contexts, max(map(len, contexts)), TOK.pad_id)
        seeds = np.array([_turn_seed(int(SEEDS[r // N]), r // N, r % N, k) for r, _, _ in turns])
        room = max(R - at for _, at, _ in turns)
        ref = reprefill.generate(state, np.asarray(cids), np.asarray(cmask),
                                 _params(n=1, max_new_tokens=room, eos_ids=stops), seed=seeds)
        rt, rm, rl = (np.asarray(x) for x in ref[:3])
        for j, (r, at, n) in enumerate(turns):
            got = rt[j][rm[j] > 0][:n]  # the loop cuts a turn at the row's budget or calls
            np.testing.assert_array_equal(out.tokens[r, at:at + n], got, err_msg=f"row {r}")
            np.testing.assert_allclose(out.logprobs[r, at:at + n], rl[j][:n], atol=1e-5,
                                       err_msg=f"row {r} turn {k}")
            checked += 1
    return checked


def test_forced_three_turn_trajectories_equal_reprefilling(forced, runner):
    """The scripted policy calls its tool, reads 42 and calls again: 3 policy turns per row.
    Each turn equals re-prefilling, the resumes prefilled exactly each turn's last token and
    the tool's result, and a second rollout compiles nothing. (Forced tokens have log-probs
    near 0 whatever the cache holds: the sampled test below checks the cache's numbers.)"""
    sampler = Sampler(forced, max_prompt_len=P, pad_id=TOK.pad_id)
    loop, out = _run(sampler, runner, nnx.state(forced))
    assert all(t.num_turns == 3 and t.stop == "max_turns" for t in out.trajectories)
    assert _check_against_reprefill(forced, loop, out) == 2 * len(out.trajectories)
    tool = sum(t["tokens"] for traj in out.trajectories for t in traj.turns
               if t["role"] == "tool")
    assert loop.prefilled == tool + 2 * len(out.trajectories)
    assert loop.turn_calls >= 3  # rows whose tools finish apart resume apart
    # Bucketed shapes: one open program, resumes of power-of-two windows and row counts (at
    # least 8 here: every row); running again compiles nothing new.
    kinds = [key[0] for key in loop.engine.compile_log]
    assert kinds.count("open") == 1
    assert {key[2] for key in loop.engine.compile_log if key[0] == "resume"} <= {(16, 8)}
    compiled = len(loop.engine.compile_log)
    ids, mask = _prompts()
    loop.run(nnx.state(forced), ids, mask, _params(), seed=SEEDS + 10)
    assert len(loop.engine.compile_log) == compiled


@pytest.fixture(scope="module")
def noisy_run(noisy, runner):
    sampler = Sampler(noisy, max_prompt_len=P, pad_id=TOK.pad_id)
    return _run(sampler, runner, nnx.state(noisy))


def test_sampled_trajectories_equal_reprefilling(noisy, noisy_run):
    """With a policy that often leaves its script (malformed calls, early answers, turns of
    different lengths, rows resuming at different columns), every turn still equals
    re-prefilling the row's context with the turn's seed. (Leaving a turn's last token out of
    the resume's prefill changes tokens here.)"""
    loop, out = noisy_run
    turns = [t.num_turns for t in out.trajectories]
    assert max(turns) == 3 and min(turns) < 3, turns
    assert len({len(_turns(t)) and _turns(t)[-1][0] for t in out.trajectories}) > 2
    assert _check_against_reprefill(noisy, loop, out) >= 6


def test_turns_cut_after_their_calls_resume_from_the_cut(runner):
    """With max_parallel_calls=2 and a policy that chains calls, a turn decodes past its second
    call and the loop cuts it there: the tokens drawn after the cut went into the cache, and
    the resume overwrites them. Every turn still equals re-prefilling."""
    model = _policy(8.0, 1.0, chain=True)
    sampler = Sampler(model, max_prompt_len=P, pad_id=TOK.pad_id)
    loop, out = _run(sampler, runner, nnx.state(model), calls=2)
    cut = [k for t in out.trajectories for k, turn in enumerate(t.turns[:-1])
           if turn["role"] == "assistant" and turn["text"].endswith("</tool_call>")
           and turn["text"].count("</tool_call>") == 2]
    assert len(cut) >= 3, cut  # cut turns that a resume follows
    assert _check_against_reprefill(model, loop, out) >= 3


def test_the_hybrid_engines_data_parallel_mesh_and_the_gpu_layout_give_the_same_trajectories(
        noisy, noisy_run, runner):
    """The loop over the hybrid engine's decode mesh (data=4, tensor=2 on 8 devices, params
    moved from FSDP training shards) and over the "gpu" cache layout gives the one-device
    trajectories; the session's cache stays split over the data-parallel rows."""
    _, want = noisy_run
    state = nnx.state(noisy)
    lay = shd.layout(MeshSpec.parse("fsdp=8").build(jax.devices()), "nested_train")
    engine = HybridEngine(lay, "data=4,tensor=2", state)
    on_mesh = Sampler(noisy, mesh=engine.decode_mesh, rules=None,
                      param_rules=engine.decode_rules, max_prompt_len=P, pad_id=TOK.pad_id)
    decode_state = engine.to_decode(jax.device_put(state, lay.state_shardings(state)))
    gpu = Sampler(noisy, max_prompt_len=P, pad_id=TOK.pad_id,
                  decode=DecodeOptions(attention="full", layout="gpu"))
    for sampler, st in ((on_mesh, decode_state), (gpu, state)):
        loop, out = _run(sampler, runner, st)
        np.testing.assert_array_equal(out.tokens, want.tokens)
        np.testing.assert_array_equal(out.gen_mask, want.gen_mask)
        np.testing.assert_allclose(out.logprobs, want.logprobs, atol=1e-5)
    ids, mask = _prompts()
    session = TurnEngine(on_mesh).open(decode_state, ids, mask, _params(), seed=SEEDS)
    session.resume({0: (3, [5, 6])}, {0: 1})
    for x in session.session.cache[0]:
        assert x.sharding.spec[0] == "data" and len(x.sharding.device_set) == 8
    assert session.session.t.sharding.spec == jax.sharding.PartitionSpec("data")


def test_a_resume_computes_only_its_rows_and_a_bad_one_is_refused(forced):
    """A resume leaves every other row of the session exactly as it was (cache, tokens,
    indices) and refuses new tokens that would not fit the row's cache, before it runs."""
    sampler = Sampler(forced, max_prompt_len=P, pad_id=TOK.pad_id)
    ids, mask = _prompts()
    session = TurnEngine(sampler).open(nnx.state(forced), ids, mask, _params(), seed=SEEDS)
    leaves = lambda: [np.asarray(x) for x in jax.tree.leaves(  # noqa: E731
        session.session._replace(keys=jax.random.key_data(session.session.keys)))]
    before = leaves()
    t = np.asarray(session.session.t)
    session.resume({2: (int(t[2]) - 1, [TOK.pad_id + 1, 5, 6]),
                    5: (int(t[5]) - 1, [TOK.pad_id + 1, 7])}, {2: 11, 5: 12})
    changed = set()
    for a, b in zip(before, leaves()):
        for r in range(a.shape[0]):
            if not np.array_equal(a[r], b[r]):
                changed.add(r)
    assert changed == {2, 5}
    assert session.prefilled == 5
    width = session.width
    with pytest.raises(ValueError, match=f"^row 0: 3 new tokens from response column "
                                         f"{width - 2} do not fit its {width} columns$"):
        session.resume({0: (width - 2, [1, 2, 3])}, {0: 1})

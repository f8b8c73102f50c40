"""Multi-turn rollouts (hfjax.agents): the turn structure, the masks, and the
log-probs and gradients the loss sees."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import ppo_arith
from hfjax.agents import AgentLoop, observation_renderer
from hfjax.controller.batch import Batch
from hfjax.data import tool_arith
from hfjax.data.batching import left_pad
from hfjax.engine import update
from hfjax.engine.sampler import Sampler, SamplingParams
from hfjax.engine.spec import MultiTurnSpec, RolloutSpec
from hfjax.models import transformer
from hfjax.models.config import ModelConfig
from hfjax.parallel.mesh import ResourcePool
from hfjax.tools import Observation, ToolRunner, resolve_tools
from hfjax.workers.actor import ActorRollout
from hfjax.workers.logprobs import response_logprobs
from hfjax.workers.spec import ActorSpec

TOK = tool_arith.tokenizer()
P, R, N = 16, 48, 2  # prompt columns, response budget, samples per prompt
CFG = ModelConfig(vocab_size=TOK.vocab_size, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=True,
                  max_position_embeddings=P + R, pad_token_id=TOK.pad_id,
                  eos_token_id=TOK.eos_id)
PROBLEMS = ["123*456=", "9876*54=", "31*2=", "4444*1234="]
CLOSE = TOK.encode("</tool_call>", add_special_tokens=False)[0]


@pytest.fixture(scope="module")
def model():
    return transformer.build(CFG, "causal_lm", seed=5)


@pytest.fixture(scope="module")
def sampler(model):
    return Sampler(model, max_prompt_len=P + R, pad_id=TOK.pad_id)


@pytest.fixture(scope="module")
def runner():
    with ToolRunner(resolve_tools("calculator"), max_workers=4) as r:
        yield r


def _prompts():
    ids, mask = left_pad([TOK.encode(p, add_special_tokens=False) for p in PROBLEMS], P,
                         TOK.pad_id)
    return np.asarray(ids), np.asarray(mask)


def _loop(sampler, runner, max_turns=3, obs_len=8, **kw):
    # The module's runner is shared by every loop the tests make (the fixture closes it).
    return AgentLoop(sampler, TOK, runner, _spec(max_turns=max_turns, obs_len=obs_len, **kw),
                     owns_runner=False)


def _spec(max_turns=3, obs_len=8, **kw):
    """The base config's `rollout.multi_turn`, enabled, with these settings."""
    base = MultiTurnSpec.of(ppo_arith.get_config().rollout.multi_turn)
    return dataclasses.replace(base, enable=True, max_turns=max_turns,
                               max_tool_response_len=obs_len, **kw)


def _params():
    return SamplingParams(max_new_tokens=R, temperature=1.0, n=N, eos_ids=(TOK.eos_id,))


@pytest.fixture(scope="module")
def rollout(model, sampler, runner):
    loop = _loop(sampler, runner)
    ids, mask = _prompts()
    from flax import nnx

    out = loop.run(nnx.state(model), ids, mask, _params(), seed=np.array([3, 4, 5, 6]))
    return loop, out


def test_turns_alternate_and_the_masks_follow_them(rollout):
    """Policy turns (mask 1) end at </tool_call> when a tool turn (mask 0) follows; the tool
    turn renders each observation as <tool_response>...</tool_response>; the trajectory's
    record matches its tokens."""
    loop, out = rollout
    assert out.tokens.shape == (len(PROBLEMS) * N, R)
    assert sum(t.tool_calls for t in out.trajectories) > 0, "no row called a tool"
    for r, traj in enumerate(out.trajectories):
        length = int(out.attn_mask[r].sum())
        assert out.attn_mask[r, :length].all() and not out.attn_mask[r, length:].any()
        assert traj.num_turns <= 3
        assert traj.stop in ("eos", "max_turns", "length", "tool_length")
        at = 0
        for k, turn in enumerate(traj.turns):
            seg = slice(at, at + turn["tokens"])
            want = 1 if turn["role"] == "assistant" else 0
            assert (out.gen_mask[r, seg] == want).all()
            if turn["role"] == "assistant" and k + 1 < len(traj.turns):
                assert out.tokens[r, at + turn["tokens"] - 1] == CLOSE
            if turn["role"] == "tool":
                text = TOK.decode(out.tokens[r, seg], skip_special_tokens=False)
                full = "".join(f"<tool_response>{x['text']}</tool_response>"
                               for x in turn["results"])
                assert full.startswith(text) and text  # cut only by the budget
                # A random policy's calls are malformed: error observations, never a crash.
                assert all(x["error"] for x in turn["results"])
            at += turn["tokens"]
        assert at == length
        assert (out.logprobs[r][out.gen_mask[r] == 0] == 0).all()


def test_one_row_and_turn_by_turn_give_the_same_log_probs(model, rollout):
    """The whole trajectory scored as one row (observations as context) gives every generated
    token the log-prob it gets scored turn by turn (its turn's context as the prompt), and the
    log-prob the sampler drew it with."""
    _, out = rollout
    ids, mask = _prompts()
    rows = np.repeat(np.arange(len(PROBLEMS)), N)
    full_ids = np.concatenate([ids[rows], out.tokens], axis=1)
    full_mask = np.concatenate([mask[rows], out.attn_mask], axis=1)
    whole, _ = response_logprobs(model, jnp.asarray(full_ids), jnp.asarray(full_mask), R, 1.0)
    whole = np.asarray(whole)
    gen = out.gen_mask > 0
    np.testing.assert_allclose(whole[gen], out.logprobs[gen], atol=2e-4)
    checked = 0
    for r, traj in enumerate(out.trajectories):
        at = 0
        for turn in traj.turns:
            if turn["role"] == "assistant" and at > 0:
                n = turn["tokens"]
                ctx = np.concatenate([ids[rows[r]][mask[rows[r]] > 0], out.tokens[r, :at]])
                seq = np.concatenate([ctx, out.tokens[r, at:at + n]])[None]
                lp, _ = response_logprobs(model, jnp.asarray(seq), jnp.ones_like(seq), n, 1.0)
                np.testing.assert_allclose(np.asarray(lp)[0], whole[r, at:at + n], atol=2e-4)
                checked += 1
            at += turn["tokens"]
        if checked >= 3:  # each turn compiles its own shapes: a few are enough
            break
    assert checked > 0, "no row had a second policy turn"


def test_a_turn_is_cut_at_the_close_tag_and_the_tool_runs(sampler, runner):
    """A policy turn that writes a calculator call and keeps going is cut right after
    </tool_call> (by its id, or by the text when the tokenizer has no single id for it); the
    real calculator's result follows as observed tokens; EOS ends the trajectory; a call at
    the turn limit is not run."""
    from hfjax.agents.loop import _Row

    for by_text in (False, True):
        loop = _loop(sampler, runner, max_turns=2)
        if by_text:
            loop.close_id = None
        call = TOK.encode(tool_arith.tool_call_text(123, 456) + "#### 1",
                          add_special_tokens=False)
        row = _Row(TOK.encode("123*456=", add_special_tokens=False))
        lps = -np.arange(1, len(call) + 1, dtype=np.float32) / 100
        loop._policy_turn(row, np.array(call), lps, {TOK.eos_id}, budget=R)
        assert TOK.decode(row.tokens, skip_special_tokens=False).endswith("</tool_call>")
        assert row.lps == pytest.approx(lps[:len(row.tokens)].tolist())
        assert not row.done and row.future is not None
        loop._tool_turn(row, budget=R)
        obs = TOK.decode([t for t, g in zip(row.tokens, row.gen) if not g],
                         skip_special_tokens=False)
        assert obs == "<tool_response>56088</tool_response>"
        assert row.traj.turns[-1]["calls"] == [
            {"name": "calculator", "arguments": {"expression": "123*456"}}]
        answer = TOK.encode("#### 56088", add_special_tokens=False) + [TOK.eos_id]
        loop._policy_turn(row, np.array(answer), np.zeros(len(answer)), {TOK.eos_id}, R)
        assert row.done and row.traj.stop == "eos" and row.traj.num_turns == 2
        # At the turn limit a further call is not run.
        row2 = _Row([1])
        loop.spec = _spec(max_turns=1)
        loop._policy_turn(row2, np.array(call), lps, {TOK.eos_id}, budget=R)
        assert row2.done and row2.traj.stop == "max_turns" and row2.future is None


def test_observations_are_cut_with_a_mark_and_a_tool_turn_that_does_not_fit_is_dropped(
        sampler, runner):
    """An observation longer than max_tool_response_len tokens is cut to it, its last tokens
    the cut mark; a tool turn that does not fit what is left of the budget is not kept half:
    it is dropped and the trajectory ends ("tool_length")."""
    from hfjax.agents.loop import _Row
    from hfjax.agents.render import CUT_MARK

    loop = _loop(sampler, runner, obs_len=8)
    call = TOK.encode(tool_arith.tool_call_text(99999999, 99999999), add_special_tokens=False)
    row = _Row([1])
    loop._policy_turn(row, np.array(call), np.zeros(len(call)), {TOK.eos_id}, budget=R)
    loop._tool_turn(row, budget=R)
    obs = TOK.decode([t for t, g in zip(row.tokens, row.gen) if not g],
                     skip_special_tokens=False)
    # 9999999800000001 (16 tokens) cut to 8: 2 of its digits, then the 6-token mark.
    assert obs == f"<tool_response>99{CUT_MARK}</tool_response>"
    assert row.traj.turns[-1]["results"] == [{"text": "99" + CUT_MARK, "error": False}]
    # A whole result has no mark.
    row = _Row([1])
    small = TOK.encode(tool_arith.tool_call_text(2, 3), add_special_tokens=False)
    loop._policy_turn(row, np.array(small), np.zeros(len(small)), {TOK.eos_id}, budget=R)
    loop._tool_turn(row, budget=R)
    assert row.traj.turns[-1]["results"] == [{"text": "6", "error": False}]
    # The tool turn needs 2 + 8 tokens; 9 are left: dropped whole, trajectory ended.
    budget = len(call) + 9
    row = _Row([1])
    loop._policy_turn(row, np.array(call), np.zeros(len(call)), {TOK.eos_id}, budget=budget)
    loop._tool_turn(row, budget=budget)
    assert row.done and row.traj.stop == "tool_length" and len(row.tokens) == len(call)
    assert [t["role"] for t in row.traj.turns] == ["assistant"]
    # With 10 left it fits exactly, and the budget is spent.
    row = _Row([1])
    loop._policy_turn(row, np.array(call), np.zeros(len(call)), {TOK.eos_id}, budget=budget + 1)
    loop._tool_turn(row, budget=budget + 1)
    assert row.done and row.traj.stop == "length" and len(row.tokens) == budget + 1


def test_several_calls_per_turn_run_in_order_up_to_the_limit(sampler, runner):
    """With max_parallel_calls=2 a turn decodes past its first call: both calls run and their
    results follow in the calls' order; a third call is cut off with the rest of the turn (the
    turn ends at the limit's close tag). With the limit 1, the turn ends at its first call."""
    from hfjax.agents.loop import _Row

    calls = [(2, 3), (40, 5), (7, 7)]
    text = "".join(tool_arith.tool_call_text(a, b) for a, b in calls)
    turn = np.array(TOK.encode(text, add_special_tokens=False) + [TOK.eos_id])
    for limit, by_text in ((2, False), (2, True), (3, False), (1, False)):
        loop = _loop(sampler, runner, max_parallel_calls=limit)
        if by_text:
            loop.close_id = None
        row = _Row([1])
        loop._policy_turn(row, turn, np.zeros(len(turn)), {TOK.eos_id}, budget=4 * R)
        kept = "".join(tool_arith.tool_call_text(a, b) for a, b in calls[:limit])
        assert TOK.decode(row.tokens, skip_special_tokens=False) == kept
        loop._tool_turn(row, budget=4 * R)
        want = [str(a * b) for a, b in calls[:limit]]
        assert [r["text"] for r in row.traj.turns[-1]["results"]] == want
        assert [c["arguments"]["expression"] for c in row.traj.turns[-1]["calls"]] == [
            f"{a}*{b}" for a, b in calls[:limit]]
        obs = TOK.decode([t for t, g in zip(row.tokens, row.gen) if not g],
                         skip_special_tokens=False)
        assert obs == "".join(f"<tool_response>{w}</tool_response>" for w in want)
        assert not row.done and row.traj.tool_errors == 0


def test_a_turn_that_ends_at_eos_with_calls_goes_on_and_one_without_ends(sampler, runner):
    """A turn that writes its calls and then its end-of-turn token (EOS) runs them and the
    trajectory goes on; when the template writes that token after the assistant's message,
    the tool turn does not repeat it. A turn without calls that ends at EOS ends the
    trajectory."""
    import copy

    from hfjax.agents.loop import _Row

    tok = copy.copy(TOK)
    tok.chat_template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}<eos>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}")
    loop = AgentLoop(sampler, tok, runner, _spec(max_parallel_calls=2))
    turn = TOK.encode(tool_arith.tool_call_text(6, 7), add_special_tokens=False) + [TOK.eos_id]
    row = _Row([1])
    loop._policy_turn(row, np.array(turn), np.zeros(len(turn)), {TOK.eos_id}, budget=2 * R)
    assert not row.done and row.ended_eos
    loop._tool_turn(row, budget=2 * R)
    text = TOK.decode(row.tokens, skip_special_tokens=False)
    assert text == tool_arith.tool_call_text(6, 7) + "<eos><tool>42<eos><assistant>"
    answer = TOK.encode("#### 42", add_special_tokens=False) + [TOK.eos_id]
    loop._policy_turn(row, np.array(answer), np.zeros(len(answer)), {TOK.eos_id}, budget=2 * R)
    assert row.done and row.traj.stop == "eos" and row.traj.num_turns == 2


def test_bad_settings_are_refused_in_one_line(model, sampler, runner):
    """max_parallel_calls (and every count) < 1, a result length with no room for the cut
    mark, a sampler that cannot hold the prompts, and a continuous engine whose
    max_cache_len cannot hold a row's kept cache are refused when the loop is built."""
    from hfjax.agents import check_agent_fits
    from hfjax.workers.groups import build_agent

    for key in ("max_parallel_calls", "max_turns", "tool_workers"):
        with pytest.raises(ValueError, match=f"^rollout.multi_turn.{key}=0; it must be an int "
                                             f">= 1 [^\n]*$"):
            AgentLoop(sampler, TOK, runner, _spec(**{key: 0}))
    with pytest.raises(ValueError, match="^rollout.multi_turn.max_tool_response_len=6 leaves "
                                         "no room for a cut result's mark"):
        AgentLoop(sampler, TOK, runner, _spec(obs_len=6))
    with pytest.raises(ValueError, match=f"max_prompt_len={P + R}; build it with "
                                         f"max_prompt_len >= {P + R + 1}$"):
        build_agent(_spec(), sampler, TOK, P + R + 1, R)
    small = Sampler(model, max_prompt_len=P + R, pad_id=TOK.pad_id)
    small.max_cache_len = P + R - 1
    with pytest.raises(ValueError, match=f"^rollout.max_cache_len={P + R - 1} cannot hold a "
                                         f"multi-turn row's cache of {P + R} tokens"):
        check_agent_fits(small, P, R)
    check_agent_fits(sampler, P, R)


def test_a_chat_template_renders_the_tool_turn():
    """With a chat template, the tool turn is what the template writes between the assistant's
    text and the next assistant turn."""
    import copy

    tok = copy.copy(TOK)
    tok.chat_template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}<end>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}")
    render = observation_renderer(tok)
    assert render([Observation("42", False)]) == "<end><tool>42<end><assistant>"
    tok.chat_template = "{{ raise_exception('no tools here') }}"
    with pytest.raises(ValueError, match="cannot render a 'tool' message"):
        observation_renderer(tok)


def _actor(model, sampler, runner):
    c = ppo_arith.get_config()
    a = c.actor
    a.ppo_mini_batch_size, a.ppo_micro_batch_size, a.use_kl_loss = len(PROBLEMS), 8, True
    a.entropy_coeff = 0.01
    c.rollout.n, c.rollout.response_length = N, R
    pool = ResourcePool("devices0-1", tuple(jax.devices()[:1]))
    agent = AgentLoop(sampler, TOK, runner, _spec())
    return ActorRollout("actor", pool, "fsdp=1", model, rules="train", sampler=sampler,
                        spec=ActorSpec.of(a), rollout=RolloutSpec.of(c.rollout),
                        eos_ids=(TOK.eos_id,),
                        agent=agent, optimizer=update.make_optimizer(1e-2, grad_clip=0.0))


def test_the_loss_sees_only_generated_tokens(model, sampler, runner):
    """Through the actor: `generate` gives observations attention but no response mask; the
    policy loss (with KL and entropy terms) has the same gradient whatever the advantages and
    old / reference log-probs say at observed tokens, and a different one when they change at a
    generated token."""
    actor = _actor(model, sampler, runner)
    ids, mask = _prompts()
    batch = Batch({"prompts": ids, "prompt_mask": mask, "seeds": np.arange(4, dtype=np.int32)},
                  meta={"data_source": [tool_arith.DATA_SOURCE] * 4})
    out = actor.generate(batch)
    r = out["responses"].shape[1]
    attn = np.asarray(out["attention_mask"])[:, -r:]
    gen = np.asarray(out["response_mask"])
    observed = (attn > 0) & (gen == 0)
    assert observed.any() and (gen <= attn).all()
    assert len(out.meta["trajectory"]) == len(PROBLEMS) * N
    np.testing.assert_array_equal(np.asarray(out["tool_calls"]),
                                  [t["tool_calls"] for t in out.meta["trajectory"]])
    rng = np.random.default_rng(0)
    base = {k: np.asarray(out[k]) for k in ("input_ids", "attention_mask", "responses",
                                            "response_mask")}
    base |= {k: rng.normal(size=gen.shape).astype(np.float32) * s + o
             for k, s, o in (("advantages", 1.0, 0.0), ("old_log_probs", 0.1, -3.0),
                             ("ref_log_prob", 0.1, -3.0))}

    @jax.jit
    def grad_fn(params, mb):
        return jax.grad(lambda p: actor._policy_loss(p, mb, update.normalisers(mb))[0])(params)

    def grads(mb):
        return grad_fn(actor.params, {k: jnp.asarray(v) for k, v in mb.items()})

    def changed(where):
        mb = dict(base)
        for k in ("advantages", "old_log_probs", "ref_log_prob"):
            mb[k] = np.where(where, mb[k] + 5.0, mb[k]).astype(np.float32)
        return grads(mb)

    g0, g_obs = grads(base), changed(observed)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g_obs)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    one_gen = np.zeros_like(observed)
    one_gen[np.argwhere(gen > 0)[0][0], np.argwhere(gen > 0)[0][1]] = True
    g_gen = changed(one_gen)
    assert any(not np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g_gen)))


@pytest.mark.slow
def test_the_continuous_engine_runs_the_same_trajectories(model, sampler, runner):
    """A loop over the continuous-batching engine runs its turns in the same kept-cache
    session (`hfjax.engine.session`) as over the static engine: the same trajectories, token
    for token."""
    from flax import nnx

    from hfjax.engine.continuous import ContinuousSampler

    ids, mask = _prompts()
    outs = []
    for s in (sampler, ContinuousSampler(model, max_prompt_len=P + R, pad_id=TOK.pad_id)):
        loop = AgentLoop(s, TOK, runner, _spec())
        outs.append(loop.run(nnx.state(model), ids[:2], mask[:2], _params(), seed=np.array([7, 8])))
    assert sum(t.num_turns for t in outs[0].trajectories) > len(outs[0].trajectories)
    np.testing.assert_array_equal(outs[0].tokens, outs[1].tokens)
    np.testing.assert_array_equal(outs[0].gen_mask, outs[1].gen_mask)
    np.testing.assert_allclose(outs[0].logprobs, outs[1].logprobs, atol=1e-5)


class _LateRunner(ToolRunner):
    """The real runner, but the first submission's observations arrive `delay` seconds late
    (a slow tool), and the time they arrive is kept."""

    def __init__(self, delay):
        super().__init__(resolve_tools("calculator"), max_workers=2)
        self.delay, self.first, self.arrived = delay, True, None

    def submit(self, calls):
        fut = super().submit(calls)
        if not self.first:
            return fut
        self.first = False
        import concurrent.futures as cf
        import threading
        import time

        late = cf.Future()

        def later():
            time.sleep(self.delay)
            self.arrived = time.perf_counter()
            late.set_result(fut.result())

        threading.Thread(target=later, daemon=True).start()
        return late


def test_rows_waiting_for_a_tool_do_not_stall_the_others(model, sampler, rollout):
    """While one row's tool call is slow, the loop decodes the other rows' next turns (their
    kept caches resume while the slow row's waits in its own): some resume starts after the
    first turn and before the slow observation arrives, and the trajectories are those of the
    run without the delay (seeds are per row and turn)."""
    import time

    from flax import nnx

    from hfjax.engine.session import TurnSession

    _, want = rollout
    starts = []
    real = TurnSession.resume

    def timed(self, *a, **k):
        starts.append(time.perf_counter())
        return real(self, *a, **k)

    runner = _LateRunner(delay=3.0)
    loop = AgentLoop(sampler, TOK, runner, _spec())
    TurnSession.resume = timed
    try:
        ids, mask = _prompts()
        out = loop.run(nnx.state(model), ids, mask, _params(), seed=np.array([3, 4, 5, 6]))
    finally:
        TurnSession.resume = real
        runner.close()
    assert runner.arrived is not None
    assert any(s < runner.arrived for s in starts), (starts, runner.arrived)
    np.testing.assert_array_equal(out.tokens, want.tokens)
    np.testing.assert_array_equal(out.gen_mask, want.gen_mask)


class _CountingTokenizer:
    """The test tokenizer, counting the tokens it decodes."""

    def __init__(self, tok):
        self.tok, self.decoded = tok, 0

    def decode(self, ids, **kw):
        self.decoded += len(ids)
        return self.tok.decode(ids, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def test_the_cut_at_the_close_tag_by_text_is_not_quadratic(sampler, runner):
    """With no single token for </tool_call>, the turn is cut by decoding prefixes: a long
    turn (the red team's: thousands of tokens, the tag at the end) decodes O(n log n) tokens,
    where decoding every prefix in turn decoded n^2 / 2, and the cut is the same as the
    shortest prefix found one token at a time."""
    tok = _CountingTokenizer(TOK)
    loop = AgentLoop(sampler, tok, runner, _spec())
    loop.close_id = None
    call = TOK.encode(tool_arith.tool_call_text(1, 2), add_special_tokens=False)
    filler = TOK.encode("7 + ", add_special_tokens=False)
    for reps in (50, 1000):
        tokens = np.array(filler * reps + call + filler * 3 + call + filler)
        n = len(tokens)
        want = next(j for j in range(n - len(call) - 3 * len(filler) - len(filler), n + 1)
                    if TOK.decode(tokens[:j].tolist(), skip_special_tokens=False)
                    .count("</tool_call>") >= 2)
        tok.decoded = 0
        assert loop._cut_at_close(tokens, 2) == want
        assert loop._cut_at_close(tokens, 3) is None
        assert tok.decoded <= 2 * n * (np.log2(n) + 2), (n, tok.decoded)

"""Partial rollouts (hfjax.engine.partial): a batch decoded under one policy version, cut at a
push, its unfinished rows continued under the next version. Checked against a reference written
here: each continued row decoded greedily token by token by full forward passes of the new
model over prompt + prefix + tokens so far (no cache), log-probs from a NumPy log-softmax."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from hfjax.data.batching import left_pad
from hfjax.engine.partial import continue_rows, cut
from hfjax.engine.sampler import Sampler, SamplingParams
from hfjax.models import transformer
from hfjax.models.config import ModelConfig

P, R, AT, N = 8, 12, 4, 2  # prompt columns, response budget, push column, samples per prompt
CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=False,
                  max_position_embeddings=P + R, pad_token_id=0, eos_token_id=1)
PROMPTS = [[5, 9, 13], [7, 3, 22, 40, 41], [11, 12], [30, 31, 32, 33, 34, 35]]
OLD, NEW = 3, 4  # policy versions


@pytest.fixture(scope="module")
def models():
    return transformer.build(CFG, "causal_lm", seed=1), transformer.build(CFG, "causal_lm", seed=2)


def _reference(model, context: list[int], room: int, eos: tuple[int, ...]):
    """Greedy tokens and log-probs of `room` more tokens after `context`, one full forward pass
    (no cache) per token over the context so far, left-padded to one width (one compile)."""
    graphdef, state = nnx.split(model)
    last = jax.jit(lambda st, i, m: nnx.merge(graphdef, st)(i, m)[:, -1])
    toks, lps, ctx = [], [], list(context)
    for _ in range(room):
        ids, mask = left_pad([ctx], P + R, 0)
        logits = np.asarray(last(state, ids, mask), np.float64)[0]
        logz = np.log(np.sum(np.exp(logits - logits.max()))) + logits.max()
        tok = int(np.argmax(logits))
        toks.append(tok)
        lps.append(logits[tok] - logz)
        ctx.append(tok)
        if tok in eos:
            break
    return toks, lps


def test_partial_rows_continue_under_the_new_weights(models):
    old, new = models
    ids, mask = left_pad(PROMPTS, P, 0)
    sampler = Sampler(old, max_prompt_len=P + R, pad_id=0)
    first = sampler.generate(nnx.state(old), ids, mask,
                             SamplingParams(max_new_tokens=AT, temperature=0.0, n=N), seed=0)
    # A stop token the old policy draws in prompt 0's rows before the push: they finish.
    stop = int(np.asarray(first.tokens)[0, 1])
    eos = (stop,)
    params = SamplingParams(max_new_tokens=R, temperature=0.0, n=N, eos_ids=eos)
    first = sampler.generate(nnx.state(old), ids, mask,
                             SamplingParams(max_new_tokens=AT, temperature=0.0, n=N,
                                            eos_ids=eos), seed=0)
    rows, live = cut(first, AT, OLD, eos)
    assert live.any() and not live.all(), live
    seeds = np.arange(len(live)) + 100
    out = continue_rows(sampler, nnx.state(new), ids, mask, N, rows, live, NEW, params, seeds)

    old_tokens = np.asarray(first.tokens)
    for r in range(len(live)):
        n_have = int(rows.mask[r].sum())
        # The prefix is kept: tokens, log-probs and versions as the old policy drew them.
        np.testing.assert_array_equal(out.tokens[r, :n_have], old_tokens[r, :n_have])
        np.testing.assert_array_equal(out.logprobs[r, :n_have], rows.logprobs[r, :n_have])
        assert (out.versions[r, :n_have] == OLD).all()
        if not live[r]:  # finished before the push: nothing after it
            assert out.mask[r, n_have:].sum() == 0 and (out.versions[r, n_have:] == -1).all()
            continue
        context = PROMPTS[r // N] + old_tokens[r, :AT].tolist()
        want, want_lp = _reference(new, context, R - AT, eos)
        got = int(out.mask[r].sum())
        assert got == AT + len(want), (r, got, want)
        np.testing.assert_array_equal(out.tokens[r, AT:got], want)
        np.testing.assert_allclose(out.logprobs[r, AT:got], want_lp, atol=1e-5)
        # The versions show the switch at the push column.
        assert (out.versions[r, :AT] == OLD).all() and (out.versions[r, AT:got] == NEW).all()
        assert (out.versions[r, got:] == -1).all()
    # Staleness per token against a trainer at step NEW + 1 with K = 2: within the bound.
    step, k = NEW + 1, 2
    assert ((step - out.versions)[out.mask > 0] <= k).all()


def test_continuation_refuses_a_sampler_too_short_for_prompt_and_prefix(models):
    old, new = models
    ids, mask = left_pad(PROMPTS, P, 0)
    short = Sampler(old, max_prompt_len=P, pad_id=0)
    first = short.generate(nnx.state(old), ids, mask,
                           SamplingParams(max_new_tokens=AT, temperature=0.0, n=1), seed=0)
    rows, live = cut(first, AT, OLD, ())
    with pytest.raises(ValueError, match="max_prompt_len"):
        continue_rows(short, nnx.state(new), ids, mask, 1, rows, live, NEW,
                      SamplingParams(max_new_tokens=R, temperature=0.0), np.zeros(4))

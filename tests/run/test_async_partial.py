"""Partial rollouts in the asynchronous loop (docs/async.md, "Partial rollouts"): refused where
they cannot run, the switch schedule against a loop that enumerates the pushes, and end to end
on a split placement of 8 CPU devices at K = 2: every response token's version and staleness
against the enumeration, every token's log-prob against full forward passes of the recorded
weights of its version over prompt + response so far (a NumPy log-softmax), the same seed twice
identical, and a run resumed from a checkpoint whose queued batches are partial equal to the
uninterrupted run."""

import dataclasses
import types

import jax
import numpy as np
import partial_credit_reward
import pytest
from flax import nnx
from support import tiny_rl_config

from hfjax.config import check_config
from hfjax.run.async_loop import AsyncRollout, switch_of, version_of
from hfjax.run.checkpoint import RunCheckpointer
from hfjax.run.trainer import Trainer
from hfjax.settings.values import ConfigError
from hfjax.workers.rollout import generate_partial, partial_column

K, STEPS, SAVED = 2, 4, 2


def partial_config(placement="split", k=K, every=1, steps=STEPS):
    c = tiny_rl_config(algorithm="grpo", placement=placement)
    c.algo.adv_estimator = "grpo"
    c.rollout.n = 2
    # Per-character credit and a large step: versions far enough apart that their log-probs
    # tell them apart.
    c.reward.custom_fn = f"{partial_credit_reward.__file__}:{partial_credit_reward.score.__name__}"
    c.actor.lr = 1e-2
    c.async_rollout.max_staleness = k
    c.async_rollout.push_every = every
    c.async_rollout.partial_rollout = True
    c.trainer.total_steps = steps
    return c


@pytest.mark.parametrize("placement,k,every,length,needle", [
    ("split", 0, 1, 8, "set --config.async_rollout.max_staleness=1 or more"),
    ("gen=4:rollout;train=4:actor+ref+reward", 0, 1, 8, "max_staleness=1 or more"),
    ("colocate", 1, 1, 8, "needs a rollout pool disjoint"),
    ("split", 1, 2, 8, "push_every <= 1"),
    ("split", 2, 3, 8, "push_every <= 2"),
    ("split", 1, 1, 1, "response_length=2 or more"),
])
def test_partial_rollouts_are_refused_where_they_cannot_run(placement, k, every, length, needle):
    c = partial_config(placement, k, every)
    c.rollout.response_length = length
    with pytest.raises(ConfigError, match=needle) as err:
        check_config(c)
    assert "\n" not in str(err.value) and "--config." in str(err.value)
    c.async_rollout.partial_rollout = False  # the same settings without it: only K=0 passes
    if k == 0:
        check_config(c)


def _pushed(start, every, upto):
    return [v for v in range(start, upto + 1) if v == start or v % every == 0]


def test_switch_is_the_next_push_when_it_lands_before_the_trainer_needs_the_batch():
    for k in range(1, 5):
        for every in range(1, k + 1):
            for start in (0, 3):
                for step in range(start, start + 12):
                    pushed = _pushed(start, every, step + every + 1)
                    first = min(v for v in pushed if v >= step - k)
                    later = [v for v in pushed if v > first]
                    want = later[0] if later[0] <= step else None
                    assert switch_of(step, k, every, start) == want, (k, every, start, step)
                    assert first == version_of(step, k, every, start)
                    if want is not None:  # both versions within the bound
                        assert 0 <= step - want < step - first <= k
    # Every push lands inside some batch: at K = 2 and every = 1, from step 1 on each batch
    # switches one version later.
    assert [switch_of(s, 2, 1) for s in range(5)] == [None, 1, 1, 2, 3]


def _numeric(m):
    return {k: v for k, v in m.items()
            if not k.startswith(("timing_s/", "perf/", "compile/", "async/push_s"))}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A run of STEPS steps at K = 2 with a checkpoint at step SAVED: its metrics, the batch
    each step trained on (host arrays) and its host prompts, the actor's weights of every
    pushed version (host, and as pushed to the rollout pool), the trainer and the checkpoint
    directory."""
    batches, prompts_of, weights, pushed = {}, {}, {}, {}
    take, push = AsyncRollout.take, AsyncRollout.push

    def recording_take(self, step):
        prompts, made = take(self, step)
        batch = made()
        prompts_of[step] = prompts
        with jax.transfer_guard("allow"):
            batches[step] = {k: np.asarray(jax.device_get(batch[k])) for k in (
                "input_ids", "attention_mask", "responses", "response_mask",
                "rollout_log_probs", "token_versions", "prompts")}
        return prompts, lambda: batch

    def recording_push(self, version):
        with jax.transfer_guard("allow"):
            weights[version] = jax.device_get(self.actor.params)
        push(self, version)
        pushed[version] = self._weights[version]

    mp = pytest.MonkeyPatch()
    mp.setattr(AsyncRollout, "take", recording_take)
    mp.setattr(AsyncRollout, "push", recording_push)
    ckpt = str(tmp_path_factory.mktemp("partial") / "ckpt")
    trainer, metrics = Trainer(partial_config()), []
    try:
        for step in range(STEPS):
            if step == SAVED:  # batches of steps 2 and 3 are queued, both partial
                trainer.save(RunCheckpointer(ckpt, async_save=False))
            metrics.append(trainer.train_step())
    finally:
        trainer._async.close()
        mp.undo()
    return types.SimpleNamespace(metrics=metrics, batches=batches, prompts=prompts_of,
                                 weights=weights, pushed=pushed, trainer=trainer, ckpt=ckpt)


def _log_softmax(trainer, params, ids, mask):
    """[rows, T, V] float64 log-probs of a full forward pass (no cache) of `params`."""
    graphdef = trainer.actor.graphdef
    x = np.asarray(jax.jit(lambda st, i, m: nnx.merge(graphdef, st)(i, m))(params, ids, mask),
                   np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


@pytest.mark.slow
def test_every_token_carries_its_scheduled_version_and_its_log_prob(recorded):
    metrics, batches, weights = recorded.metrics, recorded.batches, recorded.weights
    at = partial_column(partial_config().rollout.response_length)
    continued = 0
    for step in range(STEPS):
        b = batches[step]
        first = version_of(step, K, 1)
        switch = switch_of(step, K, 1)
        plen = b["prompts"].shape[1]
        lengths = b["response_mask"].sum(axis=1)
        # The versions the enumeration gives each token: `first` before the push column, the
        # switch after it (only rows that were still decoding there have tokens after it).
        want = np.full(b["response_mask"].shape, -1)
        for r, n in enumerate(lengths):
            for j in range(n):
                want[r, j] = first if switch is None or j < at else switch
        real = b["response_mask"] > 0
        np.testing.assert_array_equal(b["token_versions"][real], want[real], err_msg=str(step))
        age = (step - want)[real]
        assert age.max() <= K
        m = metrics[step]
        assert m["async/staleness/max"] == age.max()
        assert m["async/staleness/mean"] == pytest.approx(age.mean(), abs=1e-6)
        if switch is not None:
            # A row still decoding at the push column continues for at least one token.
            continued += int((lengths > at).sum())
            assert m["async/partial/rows"] == pytest.approx(np.mean(lengths > at), abs=1e-6)
        else:
            assert m["async/partial/rows"] == 0.0
        # Log-probs: a full forward pass of each version's recorded weights over the rows'
        # prompt + response, position plen + j - 1 predicting response token j.
        ref = {v: _log_softmax(recorded.trainer, weights[v], b["input_ids"],
                               b["attention_mask"]) for v in {first, switch} - {None}}
        other = []
        for r, n in enumerate(lengths):
            for j in range(n):
                tok = b["responses"][r, j]
                got = b["rollout_log_probs"][r, j]
                assert got == pytest.approx(ref[want[r, j]][r, plen + j - 1, tok], abs=2e-5), (
                    step, r, j)
                if want[r, j] != first:
                    other.append(abs(got - ref[first][r, plen + j - 1, tok]))
        if other:  # the continued tokens are the new version's, not the old one's
            assert max(other) > 1e-3, (step, max(other))
    assert continued > 0


@pytest.mark.slow
def test_same_seed_twice_and_a_resumed_run_equal_the_first(recorded):
    first, ckpt = recorded.metrics, recorded.ckpt
    again = Trainer(partial_config())
    try:
        second = [again.train_step() for _ in range(STEPS)]
    finally:
        again._async.close()
    for step, (a, b) in enumerate(zip(first, second, strict=True)):
        assert _numeric(a) == _numeric(b), step
    # Resumed at step 2, where the batches of steps 2 and 3 are queued: made from versions 0
    # and 1, switched to 1 and 2 (the current weights); the checkpoint holds versions 0 and 1.
    resumed = Trainer(partial_config())
    restored = resumed.resume(RunCheckpointer(ckpt, async_save=False))
    assert restored.step == SAVED and restored.state["async"]["versions"] == [1, 0]
    try:
        later = [resumed.train_step() for _ in range(SAVED, STEPS)]
    finally:
        resumed._async.close()
    for step, m in zip(range(SAVED, STEPS), later, strict=True):
        assert _numeric(m) == _numeric(first[step]), step


@pytest.mark.slow
def test_greedy_continuation_equals_greedy_decoding_of_the_new_weights(recorded):
    """The rollout group's partial generation, greedy, on step 3's prompts with weights the loop
    pushed (versions 0, then 3: far enough apart that their greedy tokens differ): every token
    is the argmax of a full forward pass of its version over prompt + tokens so far, i.e.
    greedy decoding of the old weights up to the push column and of the new ones over prompt +
    prefix after it."""
    group, step, first, switch = recorded.trainer._async.rollout, STEPS - 1, 0, STEPS - 1
    group.rollout = dataclasses.replace(group.rollout, temperature=0.0)
    batch, frac = generate_partial(group, recorded.prompts[step], recorded.pushed[first], first,
                                   lambda: recorded.pushed[switch], switch)
    with jax.transfer_guard("allow"):
        b = {k: np.asarray(jax.device_get(batch[k])) for k in (
            "input_ids", "attention_mask", "responses", "response_mask", "token_versions")}
    plen, at = (recorded.prompts[step]["prompts"].shape[1],
               partial_column(partial_config().rollout.response_length))
    lengths = b["response_mask"].sum(axis=1)
    assert frac == np.mean(lengths > at) > 0
    ref = {v: _log_softmax(recorded.trainer, recorded.weights[v], b["input_ids"],
                           b["attention_mask"]) for v in (first, switch)}
    changed = 0
    for r, n in enumerate(lengths):
        for j in range(n):
            v = first if j < at else switch
            assert b["token_versions"][r, j] == v
            tok, at_j = b["responses"][r, j], plen + j - 1
            assert tok == np.argmax(ref[v][r, at_j]), (r, j)
            changed += v == switch and tok != np.argmax(ref[first][r, at_j])
    assert changed > 0  # the continuation is the new weights' greedy decoding, not the old's

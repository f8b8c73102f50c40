"""The simulator's price of an asynchronous step against an event-by-event simulation of the
schedule hfjax.run.async_loop runs (written here as a loop over steps)."""

import pytest

from hfjax.planner.simulator import async_step_seconds
from hfjax.run.async_loop import version_of


def simulated_step_seconds(gen, train, push, k, steps=400):
    """The trainer's steady-state seconds per step: the trainer takes batch t when it is made,
    trains, pushes version t + 1; the rollout thread makes batch s once it is issued (when the
    trainer starts step s - K), its version is pushed and its previous batch is made."""
    if k == 0:
        return gen + train + push
    pushed = {0: 0.0}  # version -> time it is available on the rollout pool
    made = {}
    start = {}  # trainer step -> time it starts (takes its batch)
    rollout_free, now = 0.0, 0.0
    for t in range(steps):
        # The rollout makes every batch issued so far (up to t + K) whose version exists.
        for s in range(len(made), t + k + 1):
            v = version_of(s, k, 1)
            if v not in pushed:
                break
            issued = start.get(max(0, s - k), now)
            begin = max(rollout_free, pushed[v], issued)
            made[s] = rollout_free = begin + gen
        start[t] = now
        now = max(now, made[t]) + train + push
        pushed[t + 1] = now
    half = steps // 2
    return (now - start[half]) / (steps - half)


@pytest.mark.parametrize("gen,train,push", [(1.0, 1.0, 0.0), (0.3, 1.0, 0.05),
                                            (2.0, 0.5, 0.1), (1.0, 0.9, 0.2)])
@pytest.mark.parametrize("k", [0, 1, 2, 4])
def test_async_price_matches_the_schedule(gen, train, push, k):
    want = simulated_step_seconds(gen, train, push, k)
    assert async_step_seconds(gen, train, push, k) == pytest.approx(want, rel=1e-3)

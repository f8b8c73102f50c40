"""Sequence parallelism in the RL loop: three PPO steps with the actor's, critic's and
reference's rows split over `sequence` (fsdp=2,sequence=4) give fsdp=8's metrics within 1e-5,
by Ulysses and by ring attention, with shared-prompt rows in the update; and packed rows
(use_remove_padding) on fsdp=2,sequence=4 give fsdp=2,tensor=4's (the same packing)."""

import pytest
from support import tiny_rl_config

from hfjax.rewards.registry import register_reward
from hfjax.run.trainer import Trainer

SOURCE = "tests/sequence_parallel/digit_fraction"


@register_reward(SOURCE)
def digit_fraction(data_source, solution_str, ground_truth, extra_info):
    """A dense reward: the fraction of the response's characters that are digits."""
    return sum(ch.isdigit() for ch in solution_str) / max(len(solution_str), 1)


def three_steps(mesh: str, mode: str = "ulysses", packed: bool = False) -> list[dict[str, float]]:
    c = tiny_rl_config(mesh=mesh)
    for role in (c.actor, c.critic):
        role.use_remove_padding = packed  # packed rows cut by a token budget
    if packed:
        c.model.vocab_size = 32  # divisible by tensor=4 (the tokenizer has 18 ids)
    c.model.num_heads = c.model.num_kv_heads = 4  # kv heads divisible by sequence=4 (ulysses)
    c.rollout.n = 2  # two samples per prompt: the update trains shared-prompt rows
    c.rollout.mesh = "data=8"  # decode with whole rows, resharded from the training layout
    c.trainer.total_steps = 3
    for role in (c.actor, c.critic, c.ref):
        role.sequence_parallel = mode
    trainer = Trainer(c)
    for row in trainer.train_data.rows:
        row["data_source"] = SOURCE
    out = []
    for _ in range(3):
        m = trainer.train_step()
        out.append({k: float(v) for k, v in m.items()
                    if not k.startswith(("timing_s/", "perf/"))})
    return out


@pytest.mark.slow
def test_ppo_with_rows_split_over_sequence_matches_fsdp():
    want = three_steps("fsdp=8")
    assert want[-1]["actor/grad_norm"] > 1e-2 and want[-1]["critic/grad_norm"] > 1e-2
    for mode in ("ulysses", "ring"):
        got = three_steps("fsdp=2,sequence=4", mode)
        for step, (g, w) in enumerate(zip(got, want, strict=True)):
            assert g.keys() == w.keys()
            for k in w:
                assert g[k] == pytest.approx(w[k], abs=1e-5), (mode, step, k)


@pytest.mark.slow
def test_packed_rows_split_over_sequence_match_whole_rows():
    want = three_steps("fsdp=2,tensor=4", packed=True)
    got = three_steps("fsdp=2,sequence=4", packed=True)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.keys() == w.keys()
        for k in w:
            assert g[k] == pytest.approx(w[k], abs=1e-5), (step, k)


def test_a_dry_run_that_does_not_fit_in_training_names_sequence_parallelism():
    from hfjax.run import dry_run as dr

    def advice(worst: str) -> str:
        gib = 2**30
        program = dr.ProgramMemory(worst, "global", gib, gib, 0, 200 * gib, 0.0, gib,
                                   203 * gib, 1.0)
        run = dr.DryRun([program], {"global": {}}, 8, "gpu", "bfloat16", 141 * 10**9)
        assert not run.fits
        return run.advice()

    assert "actor.mesh with sequence=2, 4 or 8" in advice("actor.update")
    assert "ref.mesh with sequence" in advice("ref.log_prob")
    assert "sequence parallelism" not in advice("rollout.decode")  # whole rows in decoding

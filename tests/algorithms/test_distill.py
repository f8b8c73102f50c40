"""On-policy distillation (hfjax.numerics.distill, the `teacher` role, --config.algorithm=opd and
algo.distill.coef): the reverse-KL advantage against a loop reference, an OPD step with a tiny
teacher on a pool of its own whose advantages are the teacher's minus the student's log-probs,
the term added to GRPO's advantage, and the refusals (another vocabulary, a missing teacher)."""

import jax.numpy as jnp
import numpy as np
import pytest
from support import tiny_rl_config

from hfjax.algorithms.dataflow import compute_advantage
from hfjax.algorithms.registry import get_algorithm
from hfjax.algorithms.spec import StepSpec
from hfjax.config import run_roles, validate_config
from hfjax.controller.batch import Batch
from hfjax.data import arith
from hfjax.models import save_hf, transformer
from hfjax.models.config import scratch_model_config
from hfjax.numerics.distill import reverse_kl_advantage
from hfjax.run.trainer import Trainer


def loop_reference(student, teacher, mask, discount):
    out = np.zeros_like(student)
    for b in range(student.shape[0]):
        carry = 0.0
        for t in reversed(range(student.shape[1])):
            if mask[b, t]:
                carry = (teacher[b, t] - student[b, t]) + discount * carry
                out[b, t] = carry
    return out


@pytest.mark.parametrize("discount", [0.0, 0.9])
def test_reverse_kl_advantage_matches_the_loop(discount):
    rng = np.random.default_rng(0)
    s, t = rng.normal(-2, 1, (3, 7)), rng.normal(-2, 1, (3, 7))
    mask = np.array([[1, 1, 1, 1, 0, 0, 0], [1, 0, 0, 1, 1, 0, 0], [1] * 7], np.float32)
    got = reverse_kl_advantage(s.astype(np.float32), t.astype(np.float32), mask, discount)
    np.testing.assert_allclose(got, loop_reference(s, t, mask, discount), rtol=1e-5,
                               atol=1e-6)


def _teacher_dir(path, vocab=None, hidden=64):
    tok = arith.tokenizer()
    cfg = scratch_model_config(tiny_rl_config(hidden=hidden).model, vocab or tok.vocab_size,
                               tok.pad_id, tok.eos_id, 64, "float32")
    save_hf(transformer.build(cfg, "causal_lm", seed=3), str(path), tokenizer=tok)
    return str(path)


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    return _teacher_dir(tmp_path_factory.mktemp("teacher") / "hf")


def opd_config(teacher, algorithm="opd"):
    cfg = tiny_rl_config(algorithm=algorithm, placement="student=4:actor+reward;t=4:teacher")
    cfg.rollout.n, cfg.data.train_batch_size = 2, 8
    cfg.algo.distill.coef = 1.0
    cfg.teacher.path = teacher
    cfg.algo.use_kl_in_reward = False
    if algorithm == "opd":
        cfg.algo.adv_estimator, cfg.actor.use_kl_loss = "distill", False
    else:
        cfg.algo.adv_estimator = "grpo"
    return cfg


def _step(cfg):
    trainer = Trainer(cfg)
    w = trainer.workers
    batch, metrics = trainer.algo.step(w, trainer._prompts(next(trainer.train_iter)), trainer.spec)
    host = {k: np.asarray(batch[k]) for k in ("advantages", "old_log_probs", "teacher_log_prob",
                                              "response_mask")}
    return trainer, w, host, metrics


@pytest.mark.slow
def test_opd_step_scores_with_the_teacher_on_its_own_pool(teacher):
    trainer, w, b, metrics = _step(opd_config(teacher))
    assert not set(w.teacher.mesh.devices.flat) & set(w.actor.mesh.devices.flat)
    assert w.ref is None
    mask = b["response_mask"]
    want = (b["teacher_log_prob"] - b["old_log_probs"]) * mask
    np.testing.assert_allclose(b["advantages"], want, rtol=1e-5, atol=1e-6)
    assert np.abs(want).sum() > 0  # a random teacher disagrees with the student
    assert float(metrics["actor/distill_reverse_kl"]) == pytest.approx(
        float(np.sum((b["old_log_probs"] - b["teacher_log_prob"]) * mask) / mask.sum()),
        rel=1e-4)
    assert np.isfinite(float(metrics["actor/grad_norm"]))


def test_the_distill_term_adds_to_any_algorithms_advantage(teacher):
    cfg = opd_config(teacher, algorithm="grpo")
    cfg.algo.distill.coef = 0.5
    assert run_roles(get_algorithm("grpo"), cfg) == ("actor", "ref", "reward", "teacher")
    rng = np.random.default_rng(1)
    b, r = 8, 6
    mask = (np.arange(r)[None] < rng.integers(1, r + 1, (b, 1))).astype(np.float32)
    scores = np.zeros((b, r), np.float32)
    scores[np.arange(b), mask.sum(1).astype(int) - 1] = rng.integers(0, 2, b)
    student, teacher_lp = (rng.normal(-2, 1, (b, r)).astype(np.float32) for _ in range(2))
    batch = Batch({k: jnp.asarray(v) for k, v in (
        ("response_mask", mask), ("token_level_scores", scores), ("old_log_probs", student),
        ("teacher_log_prob", teacher_lp))})
    spec = StepSpec.of(cfg)
    with_term, metrics = compute_advantage(batch, spec, 0.0)
    cfg.algo.distill.coef = 0.0
    without, _ = compute_advantage(batch, StepSpec.of(cfg), 0.0)
    np.testing.assert_allclose(
        np.asarray(with_term["advantages"]) - np.asarray(without["advantages"]),
        0.5 * (teacher_lp - student) * mask, rtol=1e-5, atol=1e-6)
    assert "actor/distill_reverse_kl" in metrics


def test_refusals_are_one_line(teacher, tmp_path):
    other = _teacher_dir(tmp_path / "other", vocab=arith.tokenizer().vocab_size + 8)
    cfg = opd_config(other)
    validate_config(cfg)
    with pytest.raises(ValueError, match=r"vocabulary of \d+ tokens, the student's has \d+"):
        Trainer(cfg)
    cfg = opd_config(teacher)
    cfg.teacher.path = ""
    with pytest.raises(ValueError, match="set --config.teacher.path"):
        validate_config(cfg)
    cfg = opd_config(teacher)
    cfg.algo.distill.coef = 0.0
    with pytest.raises(ValueError, match="teacher.path is set but algo.distill.coef is 0"):
        validate_config(cfg)
    cfg = opd_config(teacher)
    cfg.actor.use_kl_loss = True
    with pytest.raises(ValueError, match="algorithm 'opd' runs with actor.use_kl_loss=False"):
        validate_config(cfg)

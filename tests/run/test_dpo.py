"""DPO and its offline relatives (hfjax.numerics.preference, hfjax.run.dpo): each registered
loss and its gradient against a NumPy reference written here, and the trainer on a tiny model
with its reference on a pool of its own: the reference scores what the policy scores at the
start (the DPO loss is log 2), training separates the pairs, and bad settings are refused in
one line."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import tiny_rl_config

from hfjax.config import check_config
from hfjax.data import prepare
from hfjax.numerics.preference import PREFERENCE_LOSSES, PreferenceInputs
from hfjax.run.dpo import DPOTrainer


def _log_sigmoid(z):
    return -math.log1p(math.exp(-z)) if z >= 0 else z - math.log1p(math.exp(z))


def _sigmoid(z):
    return 1.0 / (1.0 + math.exp(-z))


def reference(name, pc, pr, rc, rr, nc, nr, beta, eps, gamma):
    """Per pair, in plain Python: (loss, d loss / d pc, d loss / d pr)."""
    out = []
    for i in range(len(pc)):
        if name == "ipo":
            h = (pc[i] - rc[i]) / nc[i] - (pr[i] - rr[i]) / nr[i]
            g = 2.0 * (h - 1.0 / (2.0 * beta))
            out.append((g * g / 4.0, g / nc[i], -g / nr[i]))
            continue
        if name == "sigmoid":
            z, dc, dr = beta * ((pc[i] - rc[i]) - (pr[i] - rr[i])), beta, -beta
        else:  # simpo
            z = beta * (pc[i] / nc[i] - pr[i] / nr[i]) - gamma
            dc, dr = beta / nc[i], -beta / nr[i]
        loss = -(1 - eps) * _log_sigmoid(z) - eps * _log_sigmoid(-z)
        dz = -(1 - eps) * _sigmoid(-z) + eps * _sigmoid(z)
        out.append((loss, dz * dc, dz * dr))
    return np.array(out)


@pytest.mark.parametrize("name", ["sigmoid", "ipo", "simpo"])
def test_each_loss_and_its_gradient_match_the_reference(name):
    rng = np.random.default_rng(0)
    pc, pr, rc, rr = (rng.normal(-20, 5, 6).astype(np.float32) for _ in range(4))
    nc, nr = (rng.integers(3, 30, 6).astype(np.float32) for _ in range(2))
    beta, eps, gamma = 0.3, 0.1, 0.5
    want = reference(name, pc, pr, rc, rr, nc, nr, beta, eps, gamma)
    fn = PREFERENCE_LOSSES.get(name)

    def total(c, r):
        return jnp.sum(fn(PreferenceInputs(c, r, rc, rr, nc, nr, beta, eps, gamma))[0])

    losses = fn(PreferenceInputs(pc, pr, rc, rr, nc, nr, beta, eps, gamma))[0]
    gc, gr = jax.grad(total, argnums=(0, 1))(jnp.asarray(pc), jnp.asarray(pr))
    np.testing.assert_allclose(losses, want[:, 0], rtol=1e-5)
    np.testing.assert_allclose(gc, want[:, 1], rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(gr, want[:, 2], rtol=1e-4, atol=1e-7)


@pytest.fixture(scope="module")
def prefs(tmp_path_factory):
    out = tmp_path_factory.mktemp("prefs")
    prepare.prepare("arith_prefs", 48, 16, out, seed=0,
                    config={"max_b": 9, "pairs_per_prompt": 1})
    return out


def dpo_config(prefs, **dpo):
    cfg = tiny_rl_config()
    cfg.dpo.train_files = str(prefs / "train.parquet")
    cfg.dpo.val_files = str(prefs / "test.parquet")
    cfg.dpo.batch_size = cfg.dpo.micro_batch_size = 16
    cfg.dpo.steps, cfg.dpo.eval_every, cfg.dpo.lr, cfg.dpo.beta = 6, 0, 3e-3, 0.5
    cfg.data.n_test = 8
    for k, v in dpo.items():
        cfg.dpo[k] = v
    return cfg


def test_dpo_reference_on_its_own_pool_starts_at_log2_and_separates_pairs(prefs):
    cfg = dpo_config(prefs)
    cfg.placement = "policy=4:actor;reference=4:ref"
    check_config(cfg)
    trainer = DPOTrainer(cfg)
    assert trainer.pools["ref"].devices and not (
        set(trainer.pools["ref"].devices) & set(trainer.pools["actor"].devices))
    result = trainer.fit()
    before, after = result["before"], result["after"]
    # The reference is the policy as it starts: every implicit reward is 0, the loss log 2.
    assert before["val/dpo/loss"] == pytest.approx(math.log(2.0), abs=1e-5)
    assert before["val/rewards/margins"] == pytest.approx(0.0, abs=1e-5)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                "logps/chosen", "logps/rejected"):
        assert key in result["last"] and f"val/{key}" in after
    assert after["val/dpo/loss"] < before["val/dpo/loss"]
    assert after["val/rewards/margins"] > 0.0
    assert "val-core/hfjax/arith/acc/mean@1" in after


def test_simpo_builds_no_reference_and_refusals_are_one_line(prefs):
    trainer = DPOTrainer(dpo_config(prefs, loss_type="simpo"))
    assert set(trainer.pools) == {"actor"}
    trainer.cache_reference()
    assert trainer.ref is None and not trainer._ref_logps
    cfg = dpo_config(prefs)
    cfg.rollout.temperature = 0.7
    with pytest.raises(ValueError, match="set --config.rollout.temperature=1.0"):
        DPOTrainer(cfg)
    with pytest.raises(ValueError, match=r"dpo\.loss_type.*needs one of ipo, sigmoid, simpo"):
        check_config(dpo_config(prefs, loss_type="kto"))
    with pytest.raises(ValueError, match="multiple of the actor's data-parallel size 8"):
        DPOTrainer(dpo_config(prefs, micro_batch_size=4))

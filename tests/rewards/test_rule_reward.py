"""RuleReward end to end: device responses in, per-token scores out on the home mesh."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support import children_left

from hfjax.controller.batch import Batch
from hfjax.data import arith
from hfjax.data.dataset import reward_meta
from hfjax.workers.reward import RuleReward

ROUTER = '''
import time


def route(data_source, solution_str, ground_truth, extra_info):
    if extra_info and extra_info.get("mode") == "raise":
        raise ValueError("bad row")
    if extra_info and extra_info.get("mode") == "hang":
        time.sleep(60)
    return float(solution_str.strip() == "#### " + ground_truth)
'''


MESH = jax.make_mesh((8,), ("data",))


def device_batch(tok, texts, rows, width=12):
    ids = np.full((len(texts), width), tok.pad_id, np.int32)
    mask = np.zeros((len(texts), width), np.int32)
    for i, t in enumerate(texts):
        t_ids = tok.encode(t, add_special_tokens=False) + [tok.eos_id]
        ids[i, : len(t_ids)] = t_ids
        mask[i, : len(t_ids)] = 1
    sh = NamedSharding(MESH, P("data"))
    return Batch({"responses": jax.device_put(ids, sh), "response_mask": jax.device_put(mask, sh)},
                 meta=reward_meta(rows)), mask


def expected(mask, scores):
    want = np.zeros(mask.shape, np.float32)
    for i, s in enumerate(scores):
        want[i, mask[i].sum() - 1] = s
    return want


def test_builtin_rewards_in_scorer_processes():
    tok = arith.tokenizer()
    rows = arith.problems(8, seed=5)
    truths = [r["reward_model"]["ground_truth"] for r in rows]
    texts = [f"#### {t}" if i % 2 == 0 else f"#### {int(t) + 1}" for i, t in enumerate(truths)]
    texts[3] = "12"  # no marker
    batch, mask = device_batch(tok, texts, rows)
    rr = RuleReward(tok, num_processes=2, timeout_s=5.0, home=MESH)
    out = rr.compute_reward(batch)
    tls = out["token_level_scores"]
    assert tls.shape == mask.shape
    assert tls.sharding.is_equivalent_to(batch["response_mask"].sharding, 2)
    with jax.transfer_guard("allow"):
        got = np.asarray(tls)
    np.testing.assert_array_equal(got, expected(mask, [1, 0, 1, 0, 1, 0, 1, 0]))
    assert list(out.meta["response_text"]) == texts
    assert out.info == {"reward/failures": 0, "reward/timeouts": 0}
    assert children_left("hfjax.rewards.scorer", timeout_s=0)  # scored in processes
    rr.close()
    assert not children_left("hfjax.rewards.scorer")


def test_raising_and_hanging_rows_score_zero_and_are_counted(tmp_path):
    router = tmp_path / "router.py"
    router.write_text(ROUTER)
    tok = arith.tokenizer()
    rows = arith.problems(8, seed=6)
    for r, mode in zip(rows, ["ok", "raise", "ok", "hang", "ok", "ok", "raise", "ok"]):
        r["extra_info"] = dict(r["extra_info"], mode=mode)
    texts = [f"#### {r['reward_model']['ground_truth']}" for r in rows]
    batch, mask = device_batch(tok, texts, rows)
    rr = RuleReward(tok, custom_fn=f"{router}:route", num_processes=2, timeout_s=1.0)
    out = rr.compute_reward(batch)  # no home: the scores stay on the host
    got = out["token_level_scores"]
    assert isinstance(got, np.ndarray)
    np.testing.assert_array_equal(got, expected(mask, [1, 0, 1, 0, 1, 1, 0, 1]))
    assert out.info == {"reward/failures": 2, "reward/timeouts": 1}
    assert (rr.failures, rr.timeouts) == (2, 1)
    assert rr.pop_metrics() == {"reward/failures": 2.0, "reward/timeouts": 1.0}
    assert rr.pop_metrics() == {"reward/failures": 0.0, "reward/timeouts": 0.0}


def test_unknown_source_and_bad_custom_spec_raise(tmp_path):
    tok = arith.tokenizer()
    rows = arith.problems(8, seed=7)
    rows[2]["data_source"] = "nobody/knows"
    batch, _ = device_batch(tok, ["#### 1"] * 8, rows)
    with pytest.raises(ValueError, match="no reward function for data_source 'nobody/knows'"):
        RuleReward(tok, num_processes=0).compute_reward(batch)
    with pytest.raises(ValueError, match="does not exist"):
        RuleReward(tok, custom_fn=f"{tmp_path}/none.py:fn")

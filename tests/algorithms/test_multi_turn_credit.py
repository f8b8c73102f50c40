"""Multi-turn credit (docs/algorithms.md, "Multi-turn credit"): tool tokens (response_mask 0
inside the response, attention_mask 1) are context. The score sits on the last policy token;
every estimator gives tool tokens no advantage and carries its return or GAE bootstrap across
them, checked against loops written here; DAPO's batch alignment keeps them visible to
attention; and every registered algorithm, run on a batch with tool turns, gives its policy
tokens the credit the loops give and shows the update the tool results."""

import jax
import numpy as np
import pytest
from support import tiny_rl_config

from hfjax.algorithms import dapo
from hfjax.algorithms.registry import ALGORITHMS, _load_builtin
from hfjax.controller.batch import Batch
from hfjax.data import arith
from hfjax.models import save_hf, transformer
from hfjax.models.config import scratch_model_config
from hfjax.numerics import core, shaping
from hfjax.numerics.advantages import AdvantageInputs
from hfjax.rewards.registry import register_reward
from hfjax.workers.reward import scores_at_last_token

EPS = 1e-6
WHITEN_EPS = 1e-8

# ------------------------------------------------------------------------------- loop references


def last_policy_token(mask_row):
    cols = [j for j in range(len(mask_row)) if mask_row[j] > 0]
    return cols[-1] if cols else None


def loop_whiten(x, mask):
    vals = [x[i, j] for i in range(x.shape[0]) for j in range(x.shape[1]) if mask[i, j]]
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / len(vals) * len(vals) / (len(vals) - 1)
    out = np.zeros(x.shape)
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            if mask[i, j]:
                out[i, j] = (x[i, j] - mean) / (var + WHITEN_EPS) ** 0.5
    return out


def loop_gae(rewards, values, mask, gamma, lam):
    """GAE over the policy's tokens only: a tool token is skipped, so the next policy token's
    value and the running advantage reach back across it (un-whitened)."""
    b, t = rewards.shape
    out = np.zeros((b, t))
    for i in range(b):
        next_value, running = 0.0, 0.0
        for j in range(t - 1, -1, -1):
            if mask[i, j]:
                delta = rewards[i, j] + gamma * next_value - values[i, j]
                running = delta + gamma * lam * running
                next_value = values[i, j]
                out[i, j] = running
    return out


def loop_return_to_go(rewards, mask, gamma):
    """The discounted return over the policy's tokens only (tool tokens neither discount nor
    restart it)."""
    b, t = rewards.shape
    out = np.zeros((b, t))
    for i in range(b):
        running = 0.0
        for j in range(t - 1, -1, -1):
            if mask[i, j]:
                running = rewards[i, j] + gamma * running
                out[i, j] = running
    return out


def loop_groups(scores, n):
    """Per row: (group size, group mean, unbiased group std) of consecutive groups of n."""
    out = []
    for i in range(len(scores)):
        g = [scores[k] for k in range(i - i % n, i - i % n + n)]
        mean = sum(g) / len(g)
        std = (sum((s - mean) ** 2 for s in g) / (len(g) - 1)) ** 0.5 if len(g) > 1 else 1.0
        out.append((len(g), mean, std))
    return out


def loop_advantages(name, b, n, gamma=1.0, lam=1.0, lagrange=None, norm_by_std=True):
    """The advantages the estimator `name` must give the batch `b` (float64 arrays)."""
    m = b["response_mask"]
    r = b["token_level_rewards"] * m
    scores = [sum(b["token_level_rewards"][i]) for i in range(len(m))]
    rows = np.zeros(m.shape)
    if name == "gae":
        return loop_whiten(loop_gae(r, b["values"], m, gamma, lam), m)
    if name == "safe_rlhf":
        a_r = loop_gae(r, b["values"], m, gamma, lam)
        a_c = loop_gae(b["token_level_costs"] * m, b["cost_values"], m, gamma, lam)
        return loop_whiten((a_r - lagrange * a_c) / (1 + lagrange), m)
    if name == "reinforce_plus_plus":
        return loop_whiten(loop_return_to_go(r, m, gamma), m)
    if name == "remax":
        return (loop_return_to_go(r, m, 1.0) - b["reward_baselines"][:, None]) * m
    for i, (size, mean, std) in enumerate(loop_groups(scores, n)):
        if name == "grpo":
            a = scores[i] - mean if size > 1 else scores[i]
            rows[i] = a / (std + EPS) if norm_by_std else a
        elif name == "rloo":
            rows[i] = size / (size - 1) * (scores[i] - mean)
        elif name == "reinforce_plus_plus_baseline":
            rows[i] = scores[i] - mean
    out = rows * m
    return loop_whiten(out, m) if name == "reinforce_plus_plus_baseline" else out


# ----------------------------------------------------------------------- the estimators, alone


def _gapped_batch(seed=0):
    """4 rows in 2 groups of 2: policy turns with tool results between them, padding after."""
    rng = np.random.default_rng(seed)
    mask = np.array([[1, 1, 1, 0, 0, 1, 1, 0, 0, 0],
                     [1, 1, 0, 0, 0, 0, 1, 1, 1, 0],
                     [1, 1, 1, 1, 1, 1, 0, 0, 0, 0],
                     [1, 0, 0, 1, 0, 0, 1, 1, 0, 0]], np.float32)
    scores = np.array([1.0, 0.0, 0.5, 2.0], np.float32)
    rewards = scores_at_last_token(scores, mask)
    # A per-token term on policy tokens (a KL penalty in the reward), and noise on tool tokens
    # that the estimators must ignore.
    rewards = rewards + mask * rng.normal(0, 0.05, mask.shape) \
        + (1 - mask) * rng.normal(0, 5.0, mask.shape)
    return {
        "response_mask": mask,
        "token_level_rewards": rewards.astype(np.float32),
        "values": rng.normal(0, 1, mask.shape).astype(np.float32),
        "token_level_costs": scores_at_last_token(np.array([0.3, -1.0, 0.2, 0.7]), mask),
        "cost_values": rng.normal(0, 1, mask.shape).astype(np.float32),
        "reward_baselines": np.array([0.2, 0.1, 0.9, 1.5], np.float32),
    }


def test_the_score_lands_on_the_last_policy_token():
    mask = np.array([[1, 1, 1, 0, 0, 1, 1, 0], [1, 1, 0, 0, 0, 0, 0, 0], [0] * 8])
    got = scores_at_last_token(np.array([3.0, 2.0, 1.0]), mask)
    want = np.zeros((3, 8))
    want[0, 6], want[1, 1] = 3.0, 2.0  # not column sum(mask) - 1 = 4; nothing in an empty row
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.asarray(shaping.scores_on_last_token(
        np.array([3.0, 2.0, 1.0], np.float32), mask)), want)
    np.testing.assert_array_equal(np.asarray(shaping.last_token_index(mask)), [6, 1, -1])
    # The response's extent (what a budget counts): tool results included.
    attn = np.concatenate([np.ones((3, 2)), [[1] * 7 + [0], [1] * 4 + [0] * 4, [0] * 8]], 1)
    np.testing.assert_array_equal(np.asarray(shaping.response_extent(attn, 8)), [7, 4, 0])


GROUP_N = 2
ESTIMATORS = ["gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
              "remax", "safe_rlhf"]


def test_every_estimator_is_covered_here():
    # hfjax's own estimators (other test modules register user ones in the same process).
    own = {n for n in core.ADV_ESTIMATORS.names()
           if core.ADV_ESTIMATORS.get(n).__module__.startswith("hfjax.")}
    # "distill" takes nothing from rewards; its teacher term's credit across tool tokens is
    # checked against a loop in tests/algorithms/test_distill.py.
    assert own - {"distill"} <= set(ESTIMATORS)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.8)])
@pytest.mark.parametrize("name", ESTIMATORS)
def test_every_estimator_carries_credit_across_tool_tokens(name, gamma, lam):
    b = _gapped_batch()
    x = AdvantageInputs(
        token_level_rewards=b["token_level_rewards"], response_mask=b["response_mask"],
        values=b["values"], index=np.arange(4) // GROUP_N, num_groups=2,
        reward_baselines=b["reward_baselines"], token_level_costs=b["token_level_costs"],
        cost_values=b["cost_values"], lagrange_lambda=0.5, gamma=gamma, lam=lam)
    adv = np.asarray(core.ADV_ESTIMATORS.get(name)(x)[0], np.float64)
    f64 = {k: np.asarray(v, np.float64) for k, v in b.items()}
    want = loop_advantages(name, f64, GROUP_N, gamma, lam, lagrange=0.5)
    np.testing.assert_allclose(adv, want, rtol=1e-4, atol=1e-5)
    m = b["response_mask"]
    assert np.all(adv[m == 0] == 0)  # tool tokens and padding: exactly no advantage
    # Every row's first turn gets credit from the score after its tool results.
    first_turn = adv[:, 0]
    assert np.all(np.abs(first_turn) > 1e-4), first_turn


# ------------------------------------------------------------------ DAPO's batch alignment


def test_dapo_align_keeps_tool_results_in_attention():
    def gen(p, r, value):
        prompts = np.full((2, p), value, np.int32)
        resp = np.full((2, r), value, np.int32)
        pmask = np.ones((2, p), np.int32)
        rmask = np.ones((2, r), np.int32)
        rmask[:, 1:3] = 0  # tool tokens: context, not policy
        attn = np.ones((2, p + r), np.int32)
        return Batch({"prompts": prompts, "prompt_mask": pmask, "responses": resp,
                      "response_mask": rmask, "input_ids": np.concatenate([prompts, resp], 1),
                      "attention_mask": attn, "token_level_scores": rmask.astype(np.float32)})

    a, b = dapo.align([gen(4, 8, 1), gen(8, 16, 2)])
    attn, rmask = np.asarray(a["attention_mask"]), np.asarray(a["response_mask"])
    # Left-padded prompt, right-padded response; the tool tokens (response columns 1, 2) stay
    # attended to though response_mask is 0 there.
    np.testing.assert_array_equal(attn[0], [0] * 4 + [1] * 4 + [1] * 8 + [0] * 8)
    np.testing.assert_array_equal(rmask[0, :8], [1, 0, 0, 1, 1, 1, 1, 1])
    np.testing.assert_array_equal(np.asarray(b["attention_mask"])[0], [1] * 24)


# ---------------------------------------------------------------- every registered algorithm

MULTI_TURN = "tests/algorithms/multi_turn_score"
TOOL = slice(2, 4)  # response columns made tool results in rows that continue past them


@register_reward(MULTI_TURN)
def multi_turn_score(data_source, solution_str, ground_truth, extra_info):
    """Dense and varied: the share of digits, plus a little for length."""
    return (sum(ch.isdigit() for ch in solution_str) + 0.1 * len(solution_str)) / 10.0


def with_tool_turns(batch: Batch) -> Batch:
    """The rows of a generated batch whose response continues past TOOL with TOOL's tokens
    turned into a tool result: response_mask 0 (not the policy's), attention_mask 1 (context),
    no sampler log-prob; a trajectory as the agent loop returns one."""
    got = batch.fetch(["response_mask", "rollout_log_probs"])
    mask = np.array(got["response_mask"])
    lp = np.array(got["rollout_log_probs"])
    spans = mask[:, TOOL.stop] > 0
    mask[spans, TOOL] = 0
    lp[spans, TOOL] = 0.0
    rest = batch.select([k for k in batch.arrays if k not in ("response_mask",
                                                              "rollout_log_probs")])
    with jax.transfer_guard("allow"):
        up = {k: jax.device_put(v.astype(batch[k].dtype), batch[k].sharding)
              for k, v in (("response_mask", mask), ("rollout_log_probs", lp))}
    return rest.union(Batch(up))


def _settings(name, score_dirs):
    """The tiny config for algorithm `name`, set as its configs/*_arith.py sets it."""
    cfg = tiny_rl_config(algorithm=name)
    # 8 prompts: ReMax's greedy pass generates one row per prompt, over 8 devices.
    cfg.rollout.n, cfg.data.train_batch_size = 2, 8
    for role in (cfg.actor, cfg.critic, cfg.cost_critic):
        role.ppo_mini_batch_size, role.ppo_micro_batch_size = 8, 16
    a = cfg.algo
    a.adv_estimator = {"ppo": "gae", "drgrpo": "grpo", "gspo": "grpo",
                       "dapo": "grpo"}.get(name, name)
    if name == "drgrpo":
        a.norm_adv_by_std_in_grpo = False
        cfg.actor.loss_agg_mode = "seq-mean-token-sum-norm"
    if name == "gspo":
        cfg.actor.policy_loss, cfg.actor.loss_agg_mode = "gspo", "seq-mean-token-mean"
    if name == "dapo":
        a.use_kl_in_reward = False
        a.overlong_buffer.enable, a.overlong_buffer.len = True, 4
    if name == "safe_rlhf":
        cfg.reward_model.path, cfg.cost_model.path = score_dirs
        cfg.placement = "split"
    return cfg


@pytest.fixture(scope="module")
def score_dirs(tmp_path_factory):
    cfg = tiny_rl_config()
    tok = arith.tokenizer()
    mcfg = scratch_model_config(cfg.model, tok.vocab_size, tok.pad_id, tok.eos_id, 32)
    return tuple(
        save_hf(transformer.build(mcfg, "score", seed=s), str(tmp_path_factory.mktemp(name)))
        for s, name in ((1, "rm"), (2, "cost")))


def _registered():
    _load_builtin()
    # opd's advantage is the teacher's term alone, whose credit across tool tokens
    # tests/algorithms/test_distill.py checks against a loop (its step needs a teacher model).
    return tuple(n for n in ALGORITHMS.names() if n != "opd")


@pytest.mark.slow
@pytest.mark.parametrize("name", _registered())
def test_every_algorithm_credits_policy_turns_and_shows_the_tool_results(name, score_dirs):
    from hfjax.run.trainer import Trainer

    cfg = _settings(name, score_dirs)
    trainer = Trainer(cfg)
    for rows in (trainer.train_data.rows, trainer.test_data.rows):
        for row in rows:
            row["data_source"] = MULTI_TURN
    actor = trainer.actor
    generate, update = actor.generate, actor.update_actor
    actor.generate = lambda batch, **kw: with_tool_turns(generate(batch, **kw))
    seen = []
    actor.update_actor = lambda batch: seen.append(batch) or update(batch)
    lagrange = trainer.workers.lagrange.value if trainer.workers.lagrange else None
    trainer.train_step()

    b = seen[0]
    keys = ["response_mask", "attention_mask", "token_level_scores", "token_level_rewards",
            "advantages", "responses"]
    keys += [k for k in ("values", "reward_baselines", "token_level_costs", "cost_values")
             if k in b]
    got = {k: np.asarray(v, np.float64) for k, v in b.fetch(keys).items()}
    m, r = got["response_mask"], got["responses"].shape[1]
    spans = (m[:, TOOL] == 0).all(1) & (m[:, TOOL.stop] > 0)
    assert spans.sum() >= 4, "too few rows with a tool turn to test"

    # The score sits on the last policy token (beyond the tool turn), nowhere else.
    for i in range(len(m)):
        nonzero = np.flatnonzero(got["token_level_scores"][i])
        assert set(nonzero) <= {last_policy_token(m[i])}, (i, nonzero)
    # The update attends to the tool results.
    assert np.all(got["attention_mask"][spans][:, -r:][:, TOOL] == 1)
    # Advantages: exactly 0 off the policy's tokens; the loop's values on them.
    adv = got["advantages"]
    assert np.all(adv[m == 0] == 0)
    want = loop_advantages(trainer.spec.algo.adv_estimator, got, cfg.rollout.n,
                           cfg.algo.gamma, cfg.algo.lam, lagrange,
                           cfg.algo.norm_adv_by_std_in_grpo)
    np.testing.assert_allclose(adv, want, rtol=1e-4, atol=1e-4)
    # A row the estimator credits (its last policy token's advantage is not 0) is credited on
    # its first turn too, before the tool's result.
    credited = [i for i in np.flatnonzero(spans)
                if abs(adv[i, last_policy_token(m[i])]) > 1e-6]
    assert credited, "no credited row with a tool turn"
    assert all(np.all(np.abs(adv[i, :TOOL.start]) > 1e-7) for i in credited)

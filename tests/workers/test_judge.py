"""The generative judge (`reward.judge`, hfjax/workers/judge.py, hfjax/rewards/judge.py): the
verdict parsers (a regex with one group, a registered function; what does not parse is
counted), the refusals (a template without a placeholder, a parser that is neither, another
vocabulary), and one GRPO step on the arithmetic task with a tiny judge from scratch on a pool
of its own: every verdict comes from one engine call, unparsed verdicts are counted in the
step's metrics, and the scores, combined with the rule reward, are what the advantage reads."""

import dataclasses
import re

import numpy as np
import pyarrow.parquet as pq
import pytest
from support import tiny_rl_config

from hfjax.config import validate_config
from hfjax.data import arith, holdout
from hfjax.data.prepare import prepare
from hfjax.engine.buckets import prompt_bucket
from hfjax.models import save_hf, transformer
from hfjax.models.config import scratch_model_config
from hfjax.planner.config import plan_inputs
from hfjax.rewards import judge as verdicts
from hfjax.rewards.pool import ERROR, OK, RewardPool
from hfjax.rewards.registry import get_reward_fn
from hfjax.run.dry_run import abstract_groups, step_shape
from hfjax.run.trainer import Trainer
from hfjax.run.validation import generation_metrics
from hfjax.settings import ConfigError

# The test's own reading of a verdict: a digit first, else unparsed (the judge's `parser`).
LEADING_DIGIT = r"^(\d)"
DEFAULT = -1.0


@verdicts.register_verdict_parser("test_half_of_first_number")
def half_of_first_number(verdict: str) -> float | None:
    m = re.search(r"\d+", verdict)
    return None if m is None else int(m.group(0)) / 2


def test_verdict_parsers_regex_and_registered():
    fn, extra = verdicts.parser_call(r"score: (\d+)")
    assert fn(" score: 7 of 9", *extra) == 7.0 and fn("no score", *extra) is None
    fn, extra = verdicts.parser_call("test_half_of_first_number")
    assert extra == () and fn("x 9 y 4") == 4.5 and fn("none") is None
    assert verdicts.parser_call("yes_no")[0]("Yes.") == 1.0
    assert verdicts.parser_call("number")[0]("about -0.5, I think") == -0.5
    # What does not parse (None, or a group that is no number) is an error outcome of the
    # scorer pool: the judge scores it the default and counts it.
    fn, extra = verdicts.parser_call(r"is (\w+)")
    out = RewardPool(num_processes=0).map([fn] * 3, [("is 1", *extra), ("is one", *extra),
                                                      ("nothing", *extra)])
    assert [o.status for o in out] == [OK, ERROR, ERROR] and out[0].score == 1.0
    for bad, why in (("(a)(b)", "has 2 groups"), ("no_such_parser", "has 0 groups"),
                     ("(", "not a valid regular expression"), ("", "needs a registered")):
        assert why in verdicts.parser_problem(bad)


def test_render_fills_both_placeholders_once():
    assert verdicts.render("{prompt}#{response}={x}", "1+{response}", "2") == "1+{response}#2={x}"


def _judge_dir(path, vocab=None):
    tok = arith.tokenizer()
    cfg = scratch_model_config(tiny_rl_config().model, vocab or tok.vocab_size, tok.pad_id,
                               tok.eos_id, 64, "float32")
    save_hf(transformer.build(cfg, "causal_lm", seed=3), str(path), tokenizer=tok)
    return str(path)


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    return _judge_dir(tmp_path_factory.mktemp("judge") / "hf")


def judge_config(path):
    cfg = tiny_rl_config(algorithm="grpo", placement="policy=4:actor+ref+reward;j=4:judge")
    cfg.algo.adv_estimator = "grpo"
    cfg.rollout.n, cfg.data.train_batch_size = 2, 8
    cfg.actor.use_kl_loss = False  # no reference: a cheaper step
    j = cfg.reward.judge
    j.path, j.parser, j.default_score = path, LEADING_DIGIT, DEFAULT
    cfg.reward.judge_weight = 0.5  # with the rule reward's 1
    return cfg


def test_refusals_are_one_line(judge_dir, tmp_path):
    cfg = judge_config(judge_dir)
    cfg.reward.judge.template = "{prompt} is answered"
    with pytest.raises(ConfigError, match=r"reward.judge.template=.* has no \{response\}; "):
        validate_config(cfg)
    cfg = judge_config(judge_dir)
    cfg.reward.judge.parser = "(\\d)(\\d)"
    with pytest.raises(ConfigError, match="reward.judge.parser=.* it has 2 groups"):
        validate_config(cfg)
    with pytest.raises(ValueError, match="launch.plan does not place a generative judge yet"):
        plan_inputs(judge_config(judge_dir))
    cfg = judge_config(_judge_dir(tmp_path / "other", vocab=arith.tokenizer().vocab_size + 8))
    with pytest.raises(ValueError, match=r"vocabulary of \d+ tokens, the policy's has \d+"):
        Trainer(cfg)


@pytest.fixture(scope="module")
def stepped(judge_dir):
    """A trainer after one training step, that step's metrics and batch, and the judge's
    engine calls in it (rows per call)."""
    trainer = Trainer(judge_config(judge_dir))
    judge = trainer.workers.judge
    calls, batches = [], []
    generate, step = judge.sampler.generate, trainer.algo.step

    def counted(state, ids, mask, params, **kw):
        calls.append(len(ids))
        return generate(state, ids, mask, params, **kw)

    judge.sampler.generate = counted
    trainer.algo = dataclasses.replace(trainer.algo, step=lambda *a: _keep(batches, step(*a)))
    return trainer, trainer.train_step(), calls, batches[0]


def _keep(batches, out):
    batches.append(out[0])
    return out


@pytest.mark.slow  # the shared fixture: one step with its compiles, ~18 s on the shared CPU
def test_a_step_judges_every_row_in_one_engine_call(stepped):
    trainer, metrics, calls, _ = stepped
    assert calls == [16]  # 8 prompts x 2 samples, one request each, one call
    w = trainer.workers
    assert not set(w.judge.mesh.devices.flat) & set(w.actor.mesh.devices.flat)
    assert metrics["reward/judge_timeouts"] == 0
    # Validation: the judge's agreement with the rule reward on the held-out answers.
    records = []
    val = generation_metrics(w.actor, trainer.reward, trainer.test_data.rows, judge=w.judge,
                             pad_id=trainer.tok.pad_id, records=records,
                             max_prompt_length=trainer.cfg.data.max_prompt_length)
    agree = np.mean([r["judge_score"] == r["score"] for r in records])
    assert val["val-aux/judge_agreement/mean"] == pytest.approx(agree)
    assert val["val-aux/judge_scores/mean"] == pytest.approx(
        np.mean([r["judge_score"] for r in records]))


@pytest.mark.slow
def test_judge_scores_reach_the_advantage(stepped):
    trainer, metrics, _, batch = stepped
    said = list(batch.meta["judge_verdict"])
    want = np.array([float(v[0]) if v[:1].isdigit() else DEFAULT for v in said], np.float32)
    unparsed = sum(not v[:1].isdigit() for v in said)
    assert 0 < unparsed < len(said)  # this judge's verdicts hold both kinds
    assert metrics["reward/judge_unparsed"] == unparsed
    assert metrics["reward/judge_score/mean"] == pytest.approx(want.mean())
    b = batch.fetch(["judge_scores", "token_level_scores", "response_mask", "advantages"])
    np.testing.assert_array_equal(b["judge_scores"], want)
    # Combined with the rule reward: rule score + 0.5 * judge score, on the last token.
    rule, _ = trainer.reward.score_texts(list(batch.meta["response_text"]),
                                         list(batch.meta["data_source"]),
                                         list(batch.meta["ground_truth"]))
    scores = rule + 0.5 * want
    np.testing.assert_allclose(b["token_level_scores"].sum(1), scores, rtol=1e-6)
    # GRPO's advantage: each score against its prompt's two samples, on every response token.
    pairs = scores.reshape(-1, 2)
    centred = (pairs - pairs.mean(1, keepdims=True)) / (pairs.std(1, ddof=1, keepdims=True)
                                                         + 1e-6)
    np.testing.assert_allclose(b["advantages"], centred.reshape(-1, 1) * b["response_mask"],
                               rtol=1e-4, atol=1e-5)
    assert np.abs(b["advantages"]).sum() > 0


def test_the_dry_run_prices_the_judge_on_its_pool(judge_dir):
    cfg = judge_config(judge_dir)
    w = abstract_groups(cfg)
    judge = w.judge
    progs = {p.name: p for p in judge.programs(step_shape(w, cfg))}
    assert set(progs) == {"judge.prefill", "judge.decode"}
    prefill = progs["judge.prefill"]
    ids = prefill.args[1]
    # The step's 16 rows, as wide as the template's 0 tokens, a prompt's and a response's.
    assert ids.shape == (16, prompt_bucket(cfg.data.max_prompt_length
                                           + cfg.rollout.response_length))
    compiled = prefill.fn.lower(*prefill.args).compile()
    assert prefill.replaces == ("judge params",)
    assert set(compiled.input_shardings[0][1].device_set) == set(judge.mesh.devices.flat)
    assert not set(judge.mesh.devices.flat) & set(w.actor.mesh.devices.flat)


def test_judge_rows_say_what_the_rule_says(tmp_path):
    """launch.prepare_data --task=arith_judge: each row's verdict is the rule reward's score of
    the answer its prompt shows, and its test rows ask held-out problems only."""
    paths = prepare("arith_judge", 16, 8, tmp_path, config={"max_b": 9})
    rule = get_reward_fn(arith.DATA_SOURCE)
    verdicts_seen = set()
    for split in ("train", "test"):
        for row in pq.read_table(paths[split]).to_pylist():
            a, op, b, answer = re.fullmatch(r"(\d+)([+-])(\d+)=(.*)==", row["prompt"]).groups()
            truth = int(a) + int(b) if op == "+" else int(a) - int(b)
            worked, verdict = row["response"].split(" ")
            assert int(worked) == truth
            assert float(verdict) == rule(arith.DATA_SOURCE, answer, str(truth), None)
            assert verdicts.regex_verdict(row["response"], arith.JUDGE_PARSER) == float(verdict)
            assert holdout.is_heldout(f"{a}{op}{b}=") == (split == "test")
            verdicts_seen.add(verdict)
    assert verdicts_seen == {"0", "1"}

"""Custom reward loading, and the scorer pool's handling of functions that raise or hang."""

import os
import sys
import time

import pytest

from hfjax.data import arith
from hfjax.rewards.custom import CustomReward, load_custom_reward
from hfjax.rewards.pool import ERROR, OK, TIMEOUT, RewardPool, reference
from hfjax.rewards.registry import get_reward_fn
from hfjax.workers.reward import RuleReward

REWARDS = '''
import os
import time


def exact(data_source, solution_str, ground_truth, extra_info):
    print("this goes to stderr, not to the pool's answers")
    return {"score": float(solution_str.strip() == ground_truth), "note": "diagnostic"}


def boom(data_source, solution_str, ground_truth, extra_info):
    raise RuntimeError("reward exploded")


def hang(data_source, solution_str, ground_truth, extra_info):
    while True:
        time.sleep(0.05)


def nan(data_source, solution_str, ground_truth, extra_info):
    return float("nan")


def die(data_source, solution_str, ground_truth, extra_info):
    os._exit(7)


def two_args(a, b):
    return 0.0


NOT_A_FUNCTION = 3
'''


@pytest.fixture(scope="module")
def rewards_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("custom") / "my_rewards.py"
    path.write_text(REWARDS)
    return path


@pytest.fixture(scope="module")
def pool():
    p = RewardPool(num_processes=2, timeout_s=1.0)
    yield p
    p.close()


def test_load_custom_reward(rewards_file):
    fn = load_custom_reward(f"{rewards_file}:exact")
    assert fn("d", "42", "42", None)["score"] == 1.0
    # A custom function replaces the built-ins for every data source; the registry names it
    # (CustomReward) without importing it, and calling that loads the same function.
    ref = get_reward_fn("openai/gsm8k", custom_fn=f"{rewards_file}:exact")
    assert isinstance(ref, CustomReward) and ref("d", "42", "42", None)["score"] == 1.0
    assert reference(ref) == reference(fn) == ("file", f"{rewards_file}:exact")


HANGS_ON_IMPORT = """
import os
import time

open(os.environ["MARKER"], "w").write(str(os.getpid()))
while True:
    time.sleep(0.05)


def fn(data_source, solution_str, ground_truth, extra_info):
    return 1.0
"""


def test_a_reward_file_that_hangs_on_import_cannot_hang_the_controller(tmp_path, monkeypatch):
    path = tmp_path / "hangs.py"
    path.write_text(HANGS_ON_IMPORT)
    marker = tmp_path / "imported_by"
    monkeypatch.setenv("MARKER", str(marker))  # the scorer processes inherit it
    pool = RewardPool(num_processes=2, timeout_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"hangs.py:fn.*importing it took longer than 1 s "
                                         r"\(reward.timeout_s\)") as err:
        RuleReward(arith.tokenizer(), custom_fn=f"{path}:fn", pool=pool)
    assert time.monotonic() - t0 < 30  # the timeout plus starting the scorers, not forever
    assert "\n" not in str(err.value)
    # A scorer imported it; this process never did.
    assert marker.exists() and int(marker.read_text()) != os.getpid()
    assert not [m for m in sys.modules if "hangs" in m]
    assert pool._procs == []  # the stuck scorers were ended
    # The pool still serves other functions afterwards.
    out = pool.map([get_reward_fn("openai/gsm8k")], [("openai/gsm8k", "#### 7", "7", None)])
    assert out[0].score == 1.0
    pool.close()


def test_a_reward_file_that_fails_on_import_is_refused_at_start(tmp_path):
    path = tmp_path / "fails.py"
    path.write_text("raise RuntimeError('cannot import me')\ndef fn(*a):\n    return 0.0\n")
    pool = RewardPool(num_processes=1, timeout_s=5.0)
    with pytest.raises(ValueError, match=r"importing .*fails.py raised RuntimeError: cannot "
                                         r"import me"):
        RuleReward(arith.tokenizer(), custom_fn=f"{path}:fn", pool=pool)
    assert not [m for m in sys.modules if "fails" in m]
    pool.close()


@pytest.mark.parametrize(
    "spec, message",
    [
        ("{dir}/missing.py:exact", "missing.py does not exist"),
        ("{file}:nope", "has no function 'nope'; it defines: .*boom.*exact"),
        ("{file}", "must look like path/to/file.py:function_name"),
        ("{file}:NOT_A_FUNCTION", "NOT_A_FUNCTION is a int, not a function"),
        ("{file}:two_args", r"cannot be called as fn\(data_source, solution_str"),
    ],
)
def test_custom_reward_errors(rewards_file, spec, message):
    spec = spec.format(dir=rewards_file.parent, file=rewards_file)
    with pytest.raises(ValueError, match=message):
        load_custom_reward(spec)


def test_custom_reward_import_error(tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("import not_a_module_anywhere\n")
    with pytest.raises(ValueError, match="importing .*broken.py raised ModuleNotFoundError"):
        load_custom_reward(f"{bad}:fn")


def test_pool_scores_in_order(pool, rewards_file):
    exact = load_custom_reward(f"{rewards_file}:exact")
    gsm = get_reward_fn("openai/gsm8k")
    fns = [exact, gsm, exact, gsm]
    args = [("d", "7", "7", None), ("openai/gsm8k", "#### 7", "7", None),
            ("d", "8", "7", None), ("openai/gsm8k", "#### 8", "7", None)]
    out = pool.map(fns, args)
    assert [o.score for o in out] == [1.0, 1.0, 0.0, 0.0]
    assert all(o.status == OK for o in out)


def test_raising_hanging_and_broken_functions_score_zero(pool, rewards_file):
    fns = {name: load_custom_reward(f"{rewards_file}:{name}")
           for name in ("exact", "boom", "hang", "nan", "die")}
    order = ["exact", "boom", "hang", "nan", "die", "exact"]
    t0 = time.monotonic()
    out = pool.map([fns[n] for n in order], [("d", "1", "1", None)] * len(order))
    elapsed = time.monotonic() - t0
    assert [o.status for o in out] == [OK, ERROR, TIMEOUT, ERROR, ERROR, OK]
    assert [o.score for o in out] == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert "RuntimeError: reward exploded" in out[1].error
    assert "non-finite" in out[3].error
    assert "exited with code 7" in out[4].error
    assert "within 1 s" in out[2].error
    assert elapsed < 20, elapsed  # the hang is cut at ~1 s, not waited out
    # The killed scorers were replaced: the pool keeps serving.
    again = pool.map([fns["exact"]] * 4, [("d", "2", "2", None)] * 4)
    assert [o.score for o in again] == [1.0] * 4


def test_inline_mode_still_catches_errors(rewards_file):
    inline = RewardPool(num_processes=0)
    boom = load_custom_reward(f"{rewards_file}:boom")
    exact = load_custom_reward(f"{rewards_file}:exact")
    out = inline.map([boom, exact], [("d", "1", "1", None)] * 2)
    assert [(o.status, o.score) for o in out] == [(ERROR, 0.0), (OK, 1.0)]


def test_unimportable_function_is_a_clear_error():
    def local(data_source, solution_str, ground_truth, extra_info):
        return 1.0

    with pytest.raises(ValueError, match="cannot be imported by a scorer process"):
        reference(local)

"""Plan, then run: `launch.plan` plans the default task for this machine's 8 simulated CPU
devices and writes its config; `launch.train --flagfile` runs 2 PPO steps with it unchanged.
Bad input to `launch.plan` ends with one clear line."""

import json
import os
import subprocess
import sys

import pytest
from support import subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = {"sft.steps": 0, "trainer.total_steps": 2, "trainer.test_freq": 0,
       "trainer.val_before_train": False, "trainer.logger": "jsonl", "trainer.plot": False,
       "trainer.save_freq": 0, "reward.num_processes": 0, "data.n_train": 512}


@pytest.fixture(scope="module")
def env():
    return subprocess_env()  # the launchers set their own device counts


def _run(args, env, timeout=900):
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_plan_then_run_two_ppo_steps(tmp_path, env):
    flagfile = tmp_path / "plan.flags"
    out_dir = tmp_path / "run"
    overrides = [f"--config.{k}={v}" for k, v in {**RUN, "trainer.out_dir": out_dir}.items()]
    p = _run(["launch.plan", "--target=cpu", "--num_devices=8", f"--emit_config={flagfile}",
              *overrides], env)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    plan = json.loads(p.stdout.strip().splitlines()[-1])
    assert set(plan) >= {"placement", "meshes", "estimated_iteration_s", "rollout_mesh"}
    assert sum(pool["size"] for pool in plan["placement"].values()) == 8
    assert set(plan["meshes"]) == {"actor", "critic", "ref"}  # the reward is a rule (host)
    lines = flagfile.read_text().splitlines()
    placement = next(x for x in lines if x.startswith("--config.placement="))
    assert f"--config.actor.mesh={plan['meshes']['actor']}" in lines
    assert f"--config.rollout.mesh={plan['rollout_mesh']}" in lines
    assert lines.index(overrides[0]) < lines.index(placement)  # the plan's settings come last
    r = _run(["launch.train", f"--flagfile={flagfile}", "--cpu_devices=8"], env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["step"] == 2
    # The run used the plan's placement and actor mesh (launch.train's opening line).
    head = next(x for x in r.stdout.splitlines() if x.startswith("hfjax: ppo on"))
    assert placement.split("=", 1)[1] in head
    assert f"actor mesh={plan['meshes']['actor']}" in head
    with open(out_dir / "metrics.jsonl") as f:
        steps = [json.loads(x) for x in f if "timing_s/update_actor" in x]
    assert len(steps) == 2


@pytest.mark.parametrize("args,message", [
    (["--num_devices=0"], "hfjax plan: --num_devices=0: needs an int >= 1"),
    (["--num_devices=8", "--target=h300"],
     "hfjax plan: --target=h300: unknown target 'h300'; known targets"),
    (["--num_devices=8", "--efficiency=train=2"], "hfjax plan: efficiency train=2"),
    (["--num_devices=8", "--prices=xla"], "hfjax plan: flag --prices=xla: value should be one "
     "of <closed_form|compiled>"),
])
def test_bad_input_ends_with_one_clear_line(env, args, message):
    p = _run(["launch.plan", *args], env, timeout=300)
    assert p.returncode != 0
    assert message in p.stderr.strip().splitlines()[-1]


def test_compiled_prices_say_what_the_closed_forms_priced(env):
    """With no compile budget every program of the plans shown falls back to the closed forms,
    and the output names each one and why (the compiled path itself: tests/planner/
    test_compiled.py, and the documented command in the smoke tier)."""
    p = _run(["launch.plan", "--target=cpu", "--num_devices=8", "--prices=compiled",
              "--compile_budget_s=0", "--alternatives=1"], env, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    lines = p.stdout.splitlines()
    assert any(x.startswith("prices: compiled for the 2 plans shown (0 programs") for x in lines)
    fallbacks = [x for x in lines if x.startswith("  closed forms for ")]
    assert fallbacks and all(x.endswith(": compile budget of 0 s spent") for x in fallbacks)
    assert any("actor.decode" in x for x in fallbacks)
    plan = json.loads(lines[-1])
    assert plan["prices"] == "compiled" and plan["closed_form_fallbacks"] == len(fallbacks)


def test_compiled_prices_for_a_gpu_target_say_what_still_differs(env):
    """Compiled on these CPU devices for an H200, the plan says the dtypes are the GPU's and
    what is not (the compiler's temporaries, the stand-ins for GPU-only kernels)."""
    p = _run(["launch.plan", "--target=h200", "--num_devices=8", "--prices=compiled",
              "--compile_budget_s=0"], env, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    said = [x for x in p.stdout.splitlines() if x.startswith("  compiled by XLA:CPU for gpu")]
    assert len(said) == 1 and "dtypes are the gpu's" in said[0] and "Pallas" in said[0]


def test_the_paper_config_plans_the_docs_row_from_the_command_line(env):
    # docs/scaling.md: "Llama-2 7B | 16 | colocate | 227.5 | ... | data=2,fsdp=8 → data=2,tensor=8"
    p = _run(["launch.plan", "--config=configs/hybridflow_paper.py",
              "--config.model.path=preset:llama2-7b", "--target=a100-80gb", "--num_devices=16"],
             env, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    plan = json.loads(p.stdout.strip().splitlines()[-1])
    assert plan["mode"] == "colocate"
    assert plan["estimated_iteration_s"] == 227.5
    assert (plan["meshes"]["actor"], plan["rollout_mesh"]) == ("data=2,fsdp=8", "data=2,tensor=8")
    assert set(plan["meshes"]) == {"actor", "critic", "ref", "reward"}

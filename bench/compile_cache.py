"""Start-up with JAX's persistent compilation cache (on by default in every entry point), cold
and warm, side by side on this machine.

    python bench/compile_cache.py [--work=/tmp/hfjax_compile_cache] [--train_arg=...]

Each figure is one subprocess, run one after the other:
- the default job (`python -m launch.train`): seconds from start to its first RL step (the step's
  line in metrics.jsonl), with an empty cache (cold), then with the cache the cold run filled
  (warm, a fresh out_dir);
- a resume of that job from its step-0 checkpoint (after the warm start): seconds to its first
  RL step, with an empty cache, then with the cache that resume filled;
- `python -m launch.generate --prompt="What is 7 + 5?" --chat --max_new_tokens=64
  --temperature=0`: wall seconds, cold then warm.

Prints one row per measurement and a final JSON line with the figures, the cold/warm ratios and
the load average at the start and the end (absolute times on a shared machine are noisy; the
ratios are the figure to quote).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_WORK = flags.DEFINE_string("work", "/tmp/hfjax_compile_cache", "scratch directory (wiped)")
_TRAIN_ARGS = flags.DEFINE_multi_string("train_arg", [], "extra launch.train flags")
_GENERATE = ["--prompt=What is 7 + 5?", "--chat", "--max_new_tokens=64", "--temperature=0"]


def _env(cache: str) -> dict:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env["PYTHONPATH"] = ROOT
    env["JAX_COMPILATION_CACHE_DIR"] = cache
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def _first_rl_step(out: str, cache: str) -> float:
    """Seconds from launching the default job in `out` until metrics.jsonl holds step 1; the
    job is then killed (its step-0 checkpoint stays)."""
    jsonl = os.path.join(out, "metrics.jsonl")
    cmd = [sys.executable, "-m", "launch.train", f"--config.trainer.out_dir={out}",
           *_TRAIN_ARGS.value]
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, cwd=ROOT, env=_env(cache), stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    try:
        while p.poll() is None:
            if os.path.exists(jsonl) and any(json.loads(line)["step"] >= 1
                                             for line in open(jsonl) if line.strip()):
                return time.perf_counter() - t0
            time.sleep(0.05)
        raise RuntimeError(f"the job ended before its first RL step: {p.stderr.read()[-2000:]}")
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            p.wait()


def _keep_step_zero(out: str) -> None:
    # What a resume from step 0 does to the file anyway; done here so that the poll above
    # cannot see the killed run's step 1 before the resumed run rewrites the file.
    jsonl = os.path.join(out, "metrics.jsonl")
    lines = [line for line in open(jsonl) if line.strip() and json.loads(line)["step"] == 0]
    open(jsonl, "w").writelines(lines)


def _generate(cache: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "launch.generate", *_GENERATE], cwd=ROOT,
                   env=_env(cache), check=True, capture_output=True)
    return time.perf_counter() - t0


def main(_):
    work = _WORK.value
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    caches = {k: os.path.join(work, f"cache_{k}") for k in ("job", "resume", "generate")}
    load_start = os.getloadavg()
    res = {}
    res["job_cold_s"] = _first_rl_step(os.path.join(work, "run_a"), caches["job"])
    res["job_warm_s"] = _first_rl_step(os.path.join(work, "run_b"), caches["job"])
    _keep_step_zero(os.path.join(work, "run_a"))
    res["resume_cold_s"] = _first_rl_step(os.path.join(work, "run_a"), caches["resume"])
    _keep_step_zero(os.path.join(work, "run_a"))
    res["resume_warm_s"] = _first_rl_step(os.path.join(work, "run_a"), caches["resume"])
    res["generate_cold_s"] = _generate(caches["generate"])
    res["generate_warm_s"] = _generate(caches["generate"])
    for k in ("job", "resume", "generate"):
        res[f"{k}_cold_over_warm"] = res[f"{k}_cold_s"] / res[f"{k}_warm_s"]
        res[f"{k}_cache_mb"] = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in
                                   os.walk(caches[k]) for f in fs) / 1e6
    res = {k: round(v, 2) for k, v in res.items()}
    res["load_average_start"] = [round(x, 1) for x in load_start]
    res["load_average_end"] = [round(x, 1) for x in os.getloadavg()]
    for what in ("job", "resume", "generate"):
        print(f"{what:9s} cold {res[f'{what}_cold_s']:7.1f} s  warm {res[f'{what}_warm_s']:7.1f} s"
              f"  ratio {res[f'{what}_cold_over_warm']:.2f}  cache {res[f'{what}_cache_mb']} MB")
    print(json.dumps(res))


if __name__ == "__main__":
    app.run(main)

"""Helpers shared by the tests (importable as `support`: tests/ is on sys.path via conftest)."""

import contextlib
import json
import os
import subprocess
import sys

import jax
import numpy as np

from configs import ppo_arith
from hfjax.controller.batch import Batch
from hfjax.engine.spec import RolloutSpec
from hfjax.parallel.mesh import ResourcePool
from hfjax.run.metrics import is_timing_key, read_jsonl
from hfjax.tools import Tool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# The session's compilation cache has no size limit: with one, JAX takes a lock over the whole
# directory for every read and write and, for every write, reads every entry's access time to
# find what to evict, so each compile costs time in proportion to the programs compiled before
# it, and the suite's processes queue for the lock (at CI's ~6,000 entries two of three workers
# were seen waiting on it). The directory is the session's own and is removed at its end.
NO_CACHE_LIMIT = "-1"


def subprocess_env(cache_dir=None) -> dict[str, str]:
    """The environment of an hfjax command that a test runs as its own process, as a user would:
    CPU only, the project on PYTHONPATH, and XLA_FLAGS without this process's 8 simulated
    devices (the command sets its own count) but with the suite's compile flags (conftest).
    Compiled programs go to `cache_dir`, by default the session's cache that the test
    processes share, never the user's."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "HFJAX_VERBOSE")}
    if os.environ.get("HFJAX_TEST_XLA_FLAGS"):
        env["XLA_FLAGS"] = os.environ["HFJAX_TEST_XLA_FLAGS"]
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    env["JAX_COMPILATION_CACHE_DIR"] = str(cache_dir or os.environ["HFJAX_TEST_XLA_CACHE"])
    # No size limit, in every process that shares the directory (tests/conftest.py).
    env["JAX_COMPILATION_CACHE_MAX_SIZE"] = NO_CACHE_LIMIT
    return env


def train_cmd(out_dir, overrides: dict, *, cpu_devices: int) -> list[str]:
    """`python -m launch.train` on `cpu_devices` simulated CPU devices, writing to `out_dir`,
    with each of `overrides` as a `--config.<key>=<value>` flag."""
    return [sys.executable, "-m", "launch.train", f"--cpu_devices={cpu_devices}",
            f"--config.trainer.out_dir={out_dir}",
            *(f"--config.{k}={v}" for k, v in overrides.items())]


def run_train(out_dir, env, overrides: dict, *, cpu_devices: int) -> dict:
    """Runs `train_cmd` to its end in the project root, asserts that it exits 0, and returns
    the run's summary: the JSON object on the last line of its stdout."""
    p = subprocess.run(train_cmd(out_dir, overrides, cpu_devices=cpu_devices), cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def comparable_records(path) -> list[dict]:
    """The records of a metrics JSONL file without their wall-clock keys
    (`hfjax.run.metrics.is_timing_key`): what two runs of one job must agree on bit for bit."""
    return [{k: v for k, v in r.items() if not is_timing_key(k)} for r in read_jsonl(path)]


def tiny_rl_config(*, algorithm="ppo", placement="colocate", mesh=None, out_dir=None,
                   hidden=32):
    """The default config shrunk for tests: a one-layer model, 16-prompt batches, 8-token
    responses, no warm start, rewards scored in this process (where tests register theirs).

    `placement` is a mode or a mapping; `mesh` sets the actor's, critic's and reference's.
    """
    c = ppo_arith.get_config()
    c.algorithm = algorithm
    c.placement = placement
    m = c.model
    m.hidden_size, m.intermediate_size, m.head_dim = hidden, 64, 16
    m.num_layers, m.num_heads, m.num_kv_heads = 1, 2, 1
    c.data.n_train, c.data.n_test, c.data.train_batch_size = 64, 16, 16
    c.sft.steps = 0
    c.rollout.n = 1
    c.rollout.response_length = 8
    for role in (c.actor, c.critic, c.cost_critic):
        role.ppo_mini_batch_size = 8  # prompts (times rollout.n sequences)
        role.ppo_micro_batch_size = 8  # sequences: a multiple of the largest dp size, 8
    if mesh is not None:
        for role in (c.actor, c.critic, c.cost_critic, c.ref):
            role.mesh = mesh
    if out_dir is not None:
        c.trainer.out_dir = str(out_dir)
    c.trainer.sync_stage_timing = True
    c.reward.num_processes = 0
    return c


def rollout_spec(**keys) -> RolloutSpec:
    """The default config's rollout section (configs/ppo_arith.py) with `keys` set, as the
    RolloutSpec that the sampler's builder, the actor and the critics take."""
    r = ppo_arith.get_config().rollout
    for key, value in keys.items():
        if key not in r:
            raise KeyError(f"the rollout section has no key {key}")
        r[key] = value
    return RolloutSpec.of(r)


def padded_rl_batch(seed: int, rows: int, prompt: int, response: int, vocab: int,
                    samples: int = 1):
    """A host RL batch of `rows` sequences in groups of `samples` rows that share a prompt (as a
    GRPO batch's samples do; 1: every row its own prompt): left-padded prompts of 1..`prompt`
    tokens (the first group's at full length), right-padded responses of 1..`response` tokens
    (the first two at full length and 1), with advantages, old/reference log-probs, values and
    returns."""
    P, R = prompt, response
    rng = np.random.default_rng(seed)
    plen = np.repeat(rng.integers(1, P + 1, rows // samples), samples)
    rlen = rng.integers(1, R + 1, rows)
    plen[: max(2, samples)], rlen[:2] = P, (R, 1)
    ids = rng.integers(1, vocab, (rows, P + R)).astype(np.int32)
    ids[:, :P] = np.repeat(ids[::samples, :P], samples, axis=0)
    mask = np.zeros((rows, P + R), np.int32)
    for i in range(rows):
        mask[i, P - plen[i] : P + rlen[i]] = 1
    ids = ids * mask
    f = lambda: rng.normal(size=(rows, R)).astype(np.float32)  # noqa: E731
    return Batch({
        "input_ids": ids, "attention_mask": mask, "responses": ids[:, P:],
        "response_mask": mask[:, P:], "advantages": f(),
        "old_log_probs": f() * 0.1 - 3.0, "ref_log_prob": f() * 0.1 - 3.0,
        "values": f(), "returns": f(),
    })


def pool_mesh(lo, hi, spec):
    """A mesh over devices lo..hi-1, e.g. pool_mesh(4, 8, "data=2,tensor=2")."""
    return ResourcePool(f"devices{lo}-{hi}", tuple(jax.devices()[lo:hi])).mesh(spec)


@contextlib.contextmanager
def no_host_round_trip():
    """Forbids every host<->device copy, explicit or not.

    On CPU, reading a device buffer from the host is zero-copy and the device-to-host guard does
    not fire, so the host-to-device guard is what catches a round trip (its re-upload).
    """
    with (
        jax.transfer_guard_device_to_host("disallow_explicit"),
        jax.transfer_guard_host_to_device("disallow_explicit"),
    ):
        yield


def host(tree):
    """Named host copies of a pytree's leaves (copies: the device buffers get donated)."""
    with jax.transfer_guard("allow"):
        return {
            jax.tree_util.keystr(path): np.array(leaf, copy=True)
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
        }


def scripted_policy(model, successors: dict[int, int], scale: float = 40.0):
    """Rewrites the weights of `model` (a `CausalLM` with an untied head) so that it is a
    bigram policy: after token t it emits `successors[t]`, with a logit margin of `scale` over
    every other token (a temperature-1 draw picks it but for a chance of about V * e^-scale).
    Next tokens after tokens not in `successors` are whatever the head gives.

    It lets a test force a trajectory (a tool call, its answer) through the real engine,
    trainer and tools: the layers' output projections are zeroed, so the final hidden state at
    a position is the normed embedding of its token alone, and the head is solved to map each
    named token's hidden state to its successor. Needs len(successors) <= hidden_size."""
    from flax import nnx

    cfg = model.config
    if cfg.tie_word_embeddings or len(successors) > cfg.hidden_size:
        raise ValueError("scripted_policy needs an untied head and at most hidden_size tokens")
    state = nnx.state(model)
    for path, var in state.flat_state():
        if path[-1] in ("o_proj", "down_proj"):
            var.value = np.zeros_like(var.value)
    d, v = cfg.hidden_size, cfg.vocab_size
    # The head reads out the final hidden state itself first: [I | 0].
    model.lm_head.value = np.eye(d, v, dtype=np.float32)
    nnx.update(model, state)
    current = np.array(list(successors), np.int32)
    hidden = np.asarray(model(current[:, None]))[:, 0, :d]
    target = np.zeros((len(current), v), np.float32)
    target[np.arange(len(current)), [successors[int(t)] for t in current]] = scale
    head, *_ = np.linalg.lstsq(hidden.astype(np.float64), target.astype(np.float64), rcond=None)
    model.lm_head.value = head.astype(np.float32)
    return model


class AnswerTool(Tool):
    """Resolved as "support:AnswerTool": a tool without arguments that always answers "42".
    Named "calculator" because that quoted name is one token of the arith_tool tokenizer, so
    a `scripted_policy` can write a whole call, `<tool_call>{"name":"calculator"}</tool_call>`,
    one token after another."""

    name = "calculator"
    description = "Answers 42."
    parameters = {"type": "object", "properties": {}, "required": []}

    def call(self, arguments: dict) -> str:
        return "42"


def tool_call_successors(tok, after_result: str) -> dict[int, int]:
    """`scripted_policy`'s successors on the arith_tool tokenizer `tok`: after a prompt's last
    token (a digit, "=", space or newline) the policy writes the `AnswerTool` call and ends its
    turn with EOS; after a tool result (`</tool_response>`) it writes `after_result`'s one
    token ("<eos>": answer; "<tool_call>": call again)."""
    one = lambda text: tok.encode(text, add_special_tokens=False)[0]  # noqa: E731
    chain = ["<tool_call>", "{", '"name"', ":", '"calculator"', "}", "</tool_call>"]
    succ = {one(a): one(b) for a, b in zip(chain, chain[1:])}
    succ[one("</tool_call>")] = tok.eos_id
    for t in list("0123456789= \n"):
        succ[one(t)] = one("<tool_call>")
    succ[one("</tool_response>")] = tok.eos_id if after_result == "<eos>" else one(after_result)
    return succ


def python_isolation() -> str:
    """The python tool's isolation for tests that use it as a tool rather than attack its jail
    (tests/tools/test_python_jail.py does): the jail where this machine can start one, else
    "none" (e.g. inside Bazel's sandbox, where bubblewrap cannot nest)."""
    from hfjax.tools import jail

    try:
        jail.probe()
    except jail.JailUnavailable:
        return "none"
    return "jail"


# The command lines of the processes hfjax starts beside a run: tool workers
# (hfjax/tools/worker.py) and reward scorers (hfjax/rewards/scorer.py).
_WORKER_MARKS = ("hfjax.tools.worker", "hfjax.rewards.scorer")


def children_left(mark: str, timeout_s: float = 10.0) -> list[str]:
    """`hfjax_children()` whose command line holds `mark`, once they are gone or `timeout_s`
    has passed (a closed runner's threads end their workers as they see the close)."""
    import time

    deadline = time.monotonic() + timeout_s
    while (left := [c for c in hfjax_children() if mark in c]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def hfjax_children() -> list[str]:
    """This process's live child processes that are tool workers or reward scorers, as
    'pid: command line'."""
    me, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        # The parent pid follows the state, after the command name's closing parenthesis.
        fields = stat[stat.rindex(")") + 2:].split()
        if len(fields) > 1 and int(fields[1]) == me and fields[0] != "Z" \
                and any(m in cmd for m in _WORKER_MARKS):
            found.append(f"{entry}: {cmd}")
    return found


# The longest modules of the suite: seconds measured 2026-12-07 on the shared 2-core machine
# (the newest modules' from their authors' runs and the slowest tests CI printed).
# tests/conftest.py hands out the longest work first (these modules and the smoke tier's parts,
# each with its `seconds` mark), so that pytest-xdist's workers end on short modules and finish
# together instead of one worker running a long module alone.
LONGEST_MODULES: dict[str, float] = {
    "tests/run/test_process_matrix.py": 250, "tests/engine/test_sampler.py": 152,
    "tests/models/test_attention.py": 128, "tests/engine/test_continuous.py": 125,
    "tests/run/test_trainer_processes.py": 123, "tests/config/test_bad_inputs.py": 110,
    "tests/run/test_resume.py": 109, "tests/models/test_sequence_parallel_hlo.py": 109,
    "tests/engine/test_packing.py": 107, "tests/models/test_moe.py": 100,
    "tests/models/test_sequence_parallel.py": 99, "tests/workers/test_vision_training.py": 90,
    "tests/engine/test_head_chunks.py": 82, "tests/agents/test_loop.py": 80,
    "tests/run/test_dry_run.py": 73, "tests/models/test_lora_dropout.py": 73,
    "tests/run/test_sequence_parallel_run.py": 70, "tests/test_bench_builds.py": 70,
    "tests/run/test_lora_rl.py": 66, "tests/models/test_lora_export.py": 64,
    "tests/run/test_checkpoint_processes.py": 60,
    "tests/run/test_vision_language_checkpoint.py": 60, "tests/workers/test_judge.py": 50,
    "tests/run/test_dpo_trl_parity.py": 50,
}


def expected_seconds(item, root: str) -> float:
    """How long `item`'s unit of work is expected to take: its `seconds` mark (a smoke-tier
    part), else its module's LONGEST_MODULES entry, else 0."""
    mark = item.get_closest_marker("seconds")
    if mark is not None:
        return float(mark.args[0])
    return LONGEST_MODULES.get(os.path.relpath(str(item.path), root), 0.0)


def longest_first(items: list, root: str) -> list:
    """`items` (pytest items), longest expected work first (`expected_seconds`); items of equal
    expectation, and each module's own tests, in their order."""
    return sorted(items, key=lambda i: -expected_seconds(i, root))


def tiny_process_job(total_steps: int) -> dict:
    """Config overrides of the tiny default-config job the cross-process tests run on 2
    processes x 1 CPU device (tests/run/test_process_matrix.py, test_checkpoint_processes.py):
    a checkpoint every step, tests/partial_credit_reward.py's per-character credit."""
    import partial_credit_reward

    return {
        "sft.steps": 0,
        "model.hidden_size": 32, "model.intermediate_size": 64, "model.head_dim": 16,
        "model.num_layers": 1, "model.num_heads": 2, "model.num_kv_heads": 1,
        "data.n_train": 32, "data.n_test": 8, "data.train_batch_size": 4, "rollout.n": 2,
        "rollout.response_length": 12,
        "actor.ppo_mini_batch_size": 4, "actor.ppo_micro_batch_size": 8,
        "critic.ppo_mini_batch_size": 4, "critic.ppo_micro_batch_size": 8,
        "reward.num_processes": 0,
        "reward.custom_fn": f"{partial_credit_reward.__file__}:"
                            f"{partial_credit_reward.score.__name__}",
        "trainer.total_steps": total_steps, "trainer.test_freq": 0, "trainer.save_freq": 1,
        "trainer.max_to_keep": 5, "trainer.logger": "jsonl", "trainer.plot": False,
    }


def start_rank(rank: int, port: int, args: list[str], env: dict, log,
               num_processes: int = 2) -> subprocess.Popen:
    """Process `rank` of a `num_processes`-process `launch.train` on 1 CPU device each, joined
    with the process flags (no launcher), in a session of its own (a test may SIGKILL it)."""
    cmd = [sys.executable, "-u", "-m", "launch.train", "--cpu_devices=1",
           f"--coordinator_address=127.0.0.1:{port}", f"--num_processes={num_processes}",
           f"--process_id={rank}", *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)

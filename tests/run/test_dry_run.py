"""The dry run against the real run: the same programs, compiled from abstract shapes, must take
the bytes the real run's arrays hold (per device, within 5%), and its verdict must follow the
memory it is given."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from support import subprocess_env

from configs import ppo_arith
from hfjax.data import arith
from hfjax.data.batching import prompt_batch
from hfjax.engine.buckets import MIN_NEW_TOKENS_BUCKET, bucket_size, prompt_bucket
from hfjax.models import backend, save_hf, transformer
from hfjax.models.config import scratch_model_config
from hfjax.models.hf_io import load_score
from hfjax.models.presets import get_preset
from hfjax.run import dry_run as dr
from hfjax.run.trainer import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config():
    c = ppo_arith.get_config()
    c.model.path = "preset:tiny"
    c.sft.steps = 0
    c.data.n_train, c.data.n_test, c.data.train_batch_size = 64, 32, 16
    c.actor.ppo_mini_batch_size = c.critic.ppo_mini_batch_size = 8
    c.actor.ppo_micro_batch_size = c.critic.ppo_micro_batch_size = 8
    c.actor.mesh = c.ref.mesh = c.critic.mesh = "fsdp=4,tensor=2"
    c.rollout.mesh = "data=4,tensor=2"
    c.reward.num_processes = 0
    c.trainer.out_dir = "/nonexistent"  # nothing is written here
    return c


@pytest.fixture(scope="module")
def runs():
    cfg = _config()
    report = dr.dry_run(cfg, device_memory_bytes=10**9)
    trainer = Trainer(cfg)
    w = trainer.workers
    rows = next(trainer.train_iter)
    batch = prompt_batch(rows, np.arange(len(rows)), trainer.tok.pad_id,
                         cfg.data.max_prompt_length)
    batch, _ = trainer.algo.step(w, batch, trainer.spec)
    return cfg, report, w, batch


def _rows_bytes(batch, keys, rows):
    """Per-device bytes of `rows` rows of the batch's arrays `keys` (split like the batch)."""
    return sum(dr.device_bytes(batch[k]) * rows // len(batch) for k in keys)


def _program(report, name):
    return next(p for p in report.programs if p.name == name)


def test_every_program_of_the_run_is_compiled(runs):
    _, report, _, _ = runs
    names = [p.name for p in report.programs]
    assert names == ["hybrid.to_decode", "rollout.prefill", "rollout.decode", "hybrid.to_train",
                     "validate.prefill", "validate.decode", "actor.log_prob", "ref.log_prob",
                     "critic.values", "critic.update", "actor.update"]
    assert all(p.flops > 0 for p in report.programs if "hybrid" not in p.name)


def test_argument_bytes_match_the_real_arrays(runs):
    cfg, report, w, batch = runs
    seqs = ["input_ids", "attention_mask", "responses", "response_mask"]
    mini = cfg.actor.ppo_mini_batch_size * cfg.rollout.n
    # What the real run passes each program, from its own arrays.
    real = {
        "actor.update": dr.device_bytes(w.actor.params) + dr.device_bytes(w.actor.opt_state)
        + _rows_bytes(batch, [*seqs, "advantages", "old_log_probs"], mini),
        "critic.update": dr.device_bytes(w.critic.params) + dr.device_bytes(w.critic.opt_state)
        + _rows_bytes(batch, [*seqs, "values", "returns"], mini),
        "ref.log_prob": dr.device_bytes(w.ref.params)
        + _rows_bytes(batch, ["input_ids", "attention_mask"], len(batch)),
        "critic.values": dr.device_bytes(w.critic.params)
        + _rows_bytes(batch, ["input_ids", "attention_mask"], len(batch)),
    }
    for name, want in real.items():
        got = _program(report, name).argument_bytes
        assert abs(got - want) <= 0.05 * want, (name, got, want)
    # The decode copy of the actor (the hybrid engine's layout), as the engine counts it.
    decode = max(w.actor.hybrid.decode_bytes().values())
    got = _program(report, "rollout.decode").arguments["params"]
    assert abs(got - decode) <= 0.05 * decode, (got, decode)
    # The resident state is the groups' own arrays.
    held = report.resident["global"]
    assert held["actor params"] == dr.device_bytes(w.actor.params)
    assert held["critic optimizer"] == dr.device_bytes(w.critic.opt_state)


def test_verdict_follows_the_memory(runs):
    _, report, _, _ = runs
    assert report.fits and report.device_memory_bytes == 10**9
    peak = report.peak_bytes_per_device
    small = dr.DryRun(report.programs, report.resident, 8, "cpu", "float32", peak - 2**20)
    assert not small.fits
    assert small.verdict().startswith(f"does not fit by 1.00 MiB, in program {small.worst.name}")
    assert small.summary()["worst_program"] == report.worst.name


def _launch_train(*args, timeout=600):
    # The commands below compile the same programs: after the first, they are cache reads.
    return subprocess.run([sys.executable, "-m", "launch.train", *args], cwd=ROOT,
                          env=subprocess_env(),
                          capture_output=True, text=True, timeout=timeout)


# The default task on the tiny preset, on one simulated v5e chip: quick to compile.
_SMALL = ["--target=v5e", "--config.model.path=preset:tiny", "--config.actor.mesh=fsdp=1",
          "--config.ref.mesh=fsdp=1", "--config.critic.mesh=fsdp=1", "--config.sft.steps=0",
          "--config.trainer.val_before_train=False", "--config.trainer.test_freq=0"]


@pytest.mark.slow
def test_dry_run_command_says_when_it_does_not_fit():
    # (The verdict of a run that fits is checked in process, above: one command costs a
    # whole compilation.) Against 1 MiB per device (--device_memory_gib: plan against less
    # than the target has) the run does not fit: exit status 3, the verdict, one stderr line.
    big = _launch_train("--dry_run", "--num_devices=1", *_SMALL, "--device_memory_gib=0.001")
    assert big.returncode == 3, big.stdout[-3000:] + big.stderr[-3000:]
    lines = big.stdout.strip().splitlines()
    summary = json.loads(lines[-1])
    worst = summary["worst_program"]
    assert not summary["fits"] and summary["device_memory_bytes"] == 2**30 // 1000
    assert summary["target"] == "v5e" and summary["compute_dtype"] == "bfloat16"
    # A TPU target compiled here: the header says what still differs from the TPU's programs.
    assert any(x.startswith("  compiled by XLA:CPU for tpu: dtypes are the tpu's") and "splash"
               in x for x in lines)
    assert summary["peak_bytes_per_device"] == max(
        p["peak_bytes"] for p in summary["programs"].values())
    assert any(line.startswith("does not fit by ") and f"in program {worst}" in line
               for line in lines)
    last = big.stderr.strip().splitlines()[-1]
    assert last.startswith("hfjax train: the run does not fit: does not fit by "), big.stderr
    assert f"in program {worst}" in last and "MiB per device, the device has 1.02 MiB" in last
    assert "--num_devices" in last


@pytest.mark.slow
def test_real_run_checks_memory_before_loading_weights(tmp_path):
    # The same check in a real run: it stops before the weights are built and before out_dir
    # is written. (A CPU device reports no memory; --target or --device_memory_gib give it.)
    out = tmp_path / "run"
    p = _launch_train("--cpu_devices=1", *_SMALL, "--device_memory_gib=0.001",
                      f"--config.trainer.out_dir={out}")
    assert p.returncode == 3, p.stdout[-3000:] + p.stderr[-3000:]
    assert not out.exists()
    assert not json.loads(p.stdout.strip().splitlines()[-1])["fits"]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("hfjax train: the run does not fit in device memory: does not fit by")
    assert last.endswith("or pass --nomemory_check to try anyway")


@pytest.mark.parametrize("args, message", [
    (["--dry_run", "--target=h300"],
     "hfjax train: --target=h300: unknown target 'h300'; known targets: h100, h200"),
    (["--dry_run", "--config.model.path=preset:llama9"],
     "hfjax train: model.path='preset:llama9': unknown model preset 'llama9'; known:"),
    (["--target=h300"], "hfjax train: --target=h300: unknown target 'h300'"),
    (["--dry_run", "--num_devices=4", "--config.actor.mesh=fsdp=8"],
     "hfjax train: config.actor.mesh 'fsdp=8' needs 8 devices"),
])
def test_bad_input_is_one_line_before_compiling(args, message):
    p = _launch_train(*args, timeout=300)
    assert p.returncode == 1
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith(message), p.stderr[-2000:]


def _reward_dir_without_weights(path, cfg) -> str:
    """A reward model directory whose config.json is valid and whose safetensors file holds
    only the score head: its headers pass the checkpoint check, its weights cannot load."""
    from safetensors.numpy import load_file, save_file

    tok = arith.tokenizer()
    mcfg = scratch_model_config(cfg.model, tok.vocab_size, tok.pad_id, tok.eos_id, 32)
    out = save_hf(transformer.build(mcfg, "score"), str(path))
    files = [f for f in os.listdir(out) if f.endswith(".safetensors")]
    assert files
    head = None
    for f in files:
        tensors = load_file(os.path.join(out, f))
        head = tensors.get("score.weight", head)
        os.remove(os.path.join(out, f))
    save_file({"score.weight": head}, os.path.join(out, "model.safetensors"))
    return out


@pytest.mark.slow
def test_every_mode_and_the_reward_model_are_listed_without_reading_weights(tmp_path):
    cfg = _config()
    cfg.trainer.val_before_train, cfg.trainer.test_freq = False, 0
    cfg.rollout.n = 2  # shared-prompt rows (actor.share_prompt) of 2 samples
    cfg.actor.group_by_length = True  # the actor and the reference: length-grouped
    cfg.critic.use_remove_padding = True  # the critic: packed rows
    cfg.reward_model.path = _reward_dir_without_weights(tmp_path / "rm", cfg)
    cfg.reward_model.use_remove_padding = True
    with pytest.raises(ValueError, match="missing tensor"):  # a real run could not load it
        load_score(cfg.reward_model.path)
    report = dr.dry_run(cfg, device_memory_bytes=10**9)
    names = [p.name for p in report.programs]
    assert names == ["hybrid.to_decode", "rollout.prefill", "rollout.decode", "hybrid.to_train",
                     "actor.log_prob", "ref.log_prob", "critic.values", "reward_model.score",
                     "critic.update", "actor.update", "actor.update.apply"]
    assert all(p.flops > 0 for p in report.programs if "hybrid" not in p.name)
    held = report.resident["global"]
    assert held["reward_model params"] > 0 and "reward_model optimizer" not in held
    # Each group lists its programs in the mode its config selects.
    w = dr.abstract_groups(cfg)
    shape = dr.step_shape(w, cfg)
    log_prob, update, apply = w.actor.programs(shape)
    assert log_prob.fn is w.actor._logprob and log_prob.args[-1] == 2  # shared-prompt rows
    assert log_prob.args[1].shape[0] == cfg.actor.ppo_micro_batch_size  # one full-width cut
    assert update.fn is w.actor.grouped_program(w.actor._policy_loss).accumulate
    assert update.args[2]["input_ids"].shape[0] == cfg.actor.ppo_micro_batch_size
    assert apply.trains and "actor optimizer" in apply.replaces
    values, critic_update = w.critic.programs(shape)
    assert values.fn is w.critic._packed_values
    packed = w.critic.budget.shape(16, shape.width, w.critic.dp_size, "critic")
    assert critic_update.fn is w.critic.update_program(w.critic._loss, 2, packing=packed)
    (score,) = w.reward_model.programs(shape)
    assert score.fn is w.reward_model._packed_score


@pytest.mark.slow  # three dry runs: about 40 s on 2 cores
def test_remat_auto_keeps_activations_where_they_fit_and_checkpoints_where_not():
    # Long rows on a small model on one device: activations outweigh the state.
    c = ppo_arith.get_config()
    c.algorithm = "grpo"
    c.model.path = "preset:tiny"
    c.model.remat_policy = "auto"
    c.sft.steps = 0
    c.data.n_train, c.data.n_test, c.data.train_batch_size = 64, 8, 8
    c.rollout.n, c.rollout.response_length = 2, 128
    c.actor.ppo_mini_batch_size, c.actor.ppo_micro_batch_size = 8, 16
    c.actor.use_kl_loss, c.algo.adv_estimator = False, "grpo"
    c.actor.mesh = c.ref.mesh = "fsdp=1"
    c.placement = "actor=1:actor+ref+reward"
    c.trainer.test_freq, c.trainer.val_before_train = 0, False
    c.reward.num_processes = 0
    c.trainer.out_dir = "/nonexistent"
    assert dr.choose_remat(c, None) == ("none", None)  # no memory limit known (CPU)
    roomy = dr.dry_run(c, device_memory_bytes=10**12)
    assert roomy.remat_policy == "none"
    tight = int(roomy.peak_bytes_per_device / backend.REMAT_HEADROOM) - 1
    report = dr.dry_run(c, device_memory_bytes=tight)
    assert report.summary()["remat_policy"] == "full"
    assert report.peak_bytes_per_device < roomy.peak_bytes_per_device


def test_a_gpu_target_is_priced_in_its_dtypes():
    """A bf16 model dry-run for a GPU target keeps its KV cache in bfloat16, as the GPU does:
    the decode's cache bytes are half a CPU target's (which keeps it in float32, as CPUs do),
    and everything else it passes the decode is the same."""
    c = ppo_arith.get_config()
    c.algorithm = "grpo"
    c.model.path, c.model.dtype = "preset:tiny", "bfloat16"
    c.sft.steps = 0
    c.data.n_train, c.data.n_test, c.data.train_batch_size = 64, 8, 8
    c.rollout.n, c.rollout.response_length = 2, 32
    c.actor.ppo_mini_batch_size, c.actor.ppo_micro_batch_size = 8, 16
    c.actor.use_kl_loss, c.algo.adv_estimator = False, "grpo"
    c.actor.mesh = c.ref.mesh = "fsdp=1"
    c.placement = "actor=1:actor+ref+reward"
    c.trainer.test_freq, c.trainer.val_before_train = 0, False
    c.reward.num_processes = 0
    c.trainer.out_dir = "/nonexistent"
    m = get_preset("tiny")
    rows = c.data.train_batch_size * c.rollout.n  # one device
    cols = prompt_bucket(c.data.max_prompt_length) + bucket_size(32, MIN_NEW_TOKENS_BUCKET)
    elements = 2 * m.num_layers * rows * cols * m.num_kv_heads * m.head_dim  # keys and values
    got = {}
    for platform in ("cpu", "gpu"):
        report = dr.dry_run(c.copy_and_resolve_references(), platform=platform)
        assert report.compute_dtype == "bfloat16"
        decode, prefill = _program(report, "rollout.decode"), _program(report, "rollout.prefill")
        got[platform] = decode.arguments["cache and loop state"], prefill.output_bytes
    # The cache is the carry's bulk: 4 bytes an element on CPU, 2 on the GPU; the rest (tokens,
    # positions, log-probs) is the same on both.
    assert got["cpu"][0] - got["gpu"][0] == elements * (4 - 2)
    assert got["cpu"][1] - got["gpu"][1] == elements * (4 - 2)
    assert got["gpu"][0] - elements * 2 < elements // 10

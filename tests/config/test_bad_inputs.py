"""Bad settings and damaged inputs, across the entry points: each must end in one line that
names the problem and the fix, a non-zero exit, no traceback, and nothing written.

Most cases go in-process through the checks the entry points call (`hfjax.config`, the
model, tokenizer, data, checkpoint and metrics readers) and through `launch.cli.report`, which
words the exception as the entry point's line: those rows check the line. `SUBPROCESS` runs the
real commands, every entry point and every kind of mistake (a config key, a setting's value, a
flag, a mesh, a data file, a model file, a checkpoint, the processes of a run), a few at a time,
and checks what only a process can show: its whole output, its exact exit status, the inputs
it read left as they were and no output written.

The module stays whole past 600 lines: its in-process rows and its processes read one fixture
of damaged files (a damaged GGUF, safetensors, parquet, checkpoints, metrics), built once per
module, and the tables are the module.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import os
import re
import shutil
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from flax import nnx
from support import subprocess_env

import hfjax.models as M
from configs import ppo_arith
from hfjax.config import check_config, check_flags
from hfjax.data import arith, prepare
from hfjax.data.dataset import Dataset
from hfjax.models import transformer
from hfjax.models.config import ModelConfig
from hfjax.models.smollm2 import smollm2_gguf_path
from hfjax.run import metrics
from hfjax.run.checkpoint import CheckpointCorrupt, RunCheckpointer
from launch import cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# -- the inputs, good and damaged --------------------------------------------------------------


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Paths of good and damaged inputs in one temporary directory."""
    root = tmp_path_factory.mktemp("inputs")
    p = {"root": str(root)}
    tok = arith.tokenizer()
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64,
                      num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                      tie_word_embeddings=True, max_position_embeddings=64,
                      pad_token_id=tok.pad_id, eos_token_id=tok.eos_id)
    model = transformer.build(cfg, "causal_lm", seed=0)
    p["hf"] = M.save_hf(model, str(root / "hf"), tokenizer=tok)
    p["rm"] = M.save_hf(transformer.build(cfg, "score", seed=0), str(root / "rm"))

    def damaged(name, edit):
        d = str(root / name)
        shutil.copytree(p["hf"], d)
        edit(d)
        return d

    st = "model.safetensors"
    p["st_trunc"] = damaged("st_trunc", lambda d: os.truncate(
        os.path.join(d, st), os.path.getsize(os.path.join(d, st)) // 2))
    p["st_text"] = damaged("st_text", lambda d: open(os.path.join(d, st), "w").write("hello"))
    p["cfg_json"] = damaged("cfg_json", lambda d: open(os.path.join(d, "config.json"),
                                                       "w").write("{not json"))
    p["tok_json"] = damaged("tok_json", lambda d: open(os.path.join(d, "tokenizer.json"),
                                                       "w").write("{not json"))
    p["no_config"] = damaged("no_config", lambda d: os.remove(os.path.join(d, "config.json")))

    # A GGUF file cut inside its first tensor's data (a partial download), and files that are
    # not GGUF at all.
    from gguf import GGUFReader

    real = str(smollm2_gguf_path())
    cut = int(GGUFReader(real).tensors[0].data_offset) + 1000
    with open(real, "rb") as f:
        (root / "trunc.gguf").write_bytes(f.read(cut))
    p["trunc_gguf"] = str(root / "trunc.gguf")
    (root / "text.gguf").write_text("not a model")
    p["text_gguf"] = str(root / "text.gguf")
    (root / "empty.gguf").write_bytes(b"")
    p["empty_gguf"] = str(root / "empty.gguf")
    (root / "notes.txt").write_text("a file")
    p["file"] = str(root / "notes.txt")
    (root / "stuff").mkdir()
    (root / "stuff" / "keep.txt").write_text("not a model")
    p["stuff"] = str(root / "stuff")

    # Data: a good parquet file, one that is not parquet, one without the reward column.
    p["parquet"] = prepare.prepare("arith", 8, 4, str(root / "data"))["train"]
    (root / "text.parquet").write_text("not parquet")
    p["text_parquet"] = str(root / "text.parquet")
    pq.write_table(pa.table({"data_source": ["x"], "prompt": ["y"]}), root / "cols.parquet")
    p["cols_parquet"] = str(root / "cols.parquet")
    # Preference pairs without their rejected side.
    pq.write_table(pa.table({"prompt": ["1+1="], "chosen": ["#### 2"]}), root / "prefs.parquet")
    p["prefs_no_rejected"] = str(root / "prefs.parquet")

    # A PPO run with one checkpoint (step 2), its tokenizer and metrics; a copy whose arrays
    # are damaged; a copy whose metrics.jsonl has a damaged line.
    run = root / "run_ppo"
    ck = RunCheckpointer(str(run / "checkpoints"), async_save=False)
    ck.save(2, {"actor_params": nnx.split(model)[1]},
            {"step": 2, "model_config": dataclasses.asdict(cfg)}, {"algorithm": "ppo"})
    ck.wait()
    ck.close()
    tok.save(str(run / "tokenizer"))
    (run / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n{"step": 2}\n')
    p["run"] = str(run)
    shutil.copytree(run, root / "run_corrupt")
    _damage_arrays(root / "run_corrupt" / "checkpoints" / "2")
    p["run_corrupt"] = str(root / "run_corrupt")
    # A run whose newest checkpoint (2) is corrupt and whose step 1 is readable.
    fallback = root / "run_fallback"
    ck = RunCheckpointer(str(fallback / "checkpoints"), async_save=False)
    for step in (1, 2):
        ck.save(step, {"actor_params": nnx.split(model)[1]},
                {"step": step, "model_config": dataclasses.asdict(cfg)}, {"algorithm": "ppo"})
        ck.wait()
    ck.close()
    tok.save(str(fallback / "tokenizer"))
    _damage_arrays(fallback / "checkpoints" / "2")
    p["run_fallback"] = str(fallback)
    shutil.copytree(run, root / "run_badjsonl")
    (root / "run_badjsonl" / "metrics.jsonl").write_text('{"step": 0}\n{"ste\n{"step": 2}\n')
    p["run_badjsonl"] = str(root / "run_badjsonl")

    # Custom reward files: one that hangs while importing, one that raises.
    (root / "hang_reward.py").write_text(
        "import time\nwhile True:\n    time.sleep(0.1)\n\n\ndef fn(*args):\n    return 1.0\n")
    p["hang_reward"] = str(root / "hang_reward.py")
    return p


def _damage_arrays(step_dir):
    """Truncates the array data files that a restore reads (`<item>/d/*`)."""
    for d, _, names in os.walk(step_dir / "actor_params"):
        for n in names:
            if os.path.basename(d) == "d":
                os.truncate(os.path.join(d, n), 8)


def _tree(path) -> dict | None:
    """{relative path: (size, sha1)} of every file under `path` (or of the file itself); None
    when the path does not exist."""
    if not os.path.exists(path):
        return None
    if os.path.isfile(path):
        return {".": _digest(path)}
    out = {}
    for d, _, names in os.walk(path):
        for n in names:
            f = os.path.join(d, n)
            out[os.path.relpath(f, path)] = _digest(f)
    return out


def _digest(f):
    with open(f, "rb") as fh:
        return os.path.getsize(f), hashlib.sha1(fh.read()).hexdigest()


# -- train config: every key's range and every rule between keys -------------------------------


def _set(**kv):
    def change(c, files):
        for key, value in kv.items():
            *parents, leaf = key.split("__")
            node = c
            for part in parents:
                node = node[part]
            node[leaf] = value.format(**files) if isinstance(value, str) else value

    return change


def _do(fn):
    return lambda c, files: fn(c)


CONFIG_CASES = [
    ("algorithm", _set(algorithm="ppo2"),
     r"algorithm='ppo2': unknown algorithm 'ppo2'; known: .*grpo, .*ppo, .*or a user algorithm "
     r"as --config.algorithm=package.module:step"),
    ("seed", _set(seed=-1), r"seed=-1: needs an int >= 0"),
    ("placement-mode", _set(placement="colocated"), r"placement='colocated': needs one of "
     r"colocate, split, standalone, a mapping"),
    ("placement-item", _set(placement="gen=x:actor"), r"placement item 'gen=x:actor': write "
     r"pool=size:role\+role"),
    ("model-missing", _set(model__path="/no/such/model"), r"model.path=.*no such file"),
    ("model-not-gguf", _set(model__path="{file}"), r"is a file but not a .gguf"),
    ("model-no-config", _set(model__path="{no_config}"), r"has no config.json"),
    ("vocab", _set(model__vocab_size=-1), r"model.vocab_size=-1: needs an int >= 0"),
    ("vocab-small", _set(model__vocab_size=5), r"model.vocab_size=5 is smaller than the "
     r"tokenizer's"),
    ("layers", _set(model__num_layers=0), r"model.num_layers=0: needs an int >= 1"),
    ("gqa", _set(model__num_heads=3, model__num_kv_heads=2), r"num_heads=3 is not a multiple"),
    ("head-dim", _set(model__head_dim=15), r"model.head_dim=15 must be even"),
    ("dtype", _set(model__dtype="float64"), r"model.dtype='float64': needs one of float32"),
    ("remat", _set(model__remat_policy="sometimes"), r"model.remat_policy='sometimes'"),
    ("positions", _set(model__path="{hf}", rollout__response_length=100),
     r"108 positions, more than model.path's max_position_embeddings=64; shorten them, or use "
     r"a model with a longer context"),
    ("rm-positions", _set(reward_model__path="{rm}", rollout__response_length=100),
     r"108 positions, more than reward_model.path's max_position_embeddings=64"),
    ("task", _set(data__task="json"),
     r"data.task='json': needs one of arith, arith_chain, arith_tool, shapes, parquet"),
    ("parquet-no-files", _set(data__task="parquet", sft__steps=0),
     r"data.task='parquet' needs data.train_files"),
    ("parquet-sft", _set(data__task="parquet", data__train_files="{parquet}",
                         data__val_files="{parquet}"),
     r"sft.steps=1000: the warm start uses the arith task's demonstrations.*sft.steps=0"),
    ("files-ignored", _set(data__train_files="{parquet}"), r"data.task='arith' ignores them"),
    ("file-missing", _set(data__task="parquet", data__train_files="/no/such.parquet"),
     r"no such file: /no/such.parquet"),
    ("n-train", _set(data__n_train=0), r"data.n_train=0: needs an int >= 1"),
    ("batch", _set(data__train_batch_size=0), r"data.train_batch_size=0"),
    ("n-train-small", _set(data__n_train=10), r"n_train=10 is smaller than one batch"),
    ("prompt-length", _set(data__max_prompt_length=0), r"max_prompt_length=0"),
    ("sft-steps", _set(sft__steps=-1), r"sft.steps=-1: needs an int >= 0"),
    ("sft-lr", _set(sft__lr=-1e-3), r"sft.lr=-0.001: needs a float >= 0"),
    ("sft-lr-nan", _set(sft__lr=float("nan")), r"sft.lr=nan: needs a float >= 0"),
    ("corruption", _set(sft__corruption="carr"), r"sft.corruption='carr': needs one of format, "
     r"carry, none"),
    ("corrupt-frac", _set(sft__corrupt_frac=1.5), r"sft.corrupt_frac=1.5: needs a float in "
     r"\[0, 1\]"),
    ("sft-micro", _set(sft__micro_batch_size=48), r"sft.micro_batch_size=48 does not divide"),
    ("mesh-size", _set(actor__mesh="fsdp=0"), r"axis 'fsdp' has size 0"),
    ("mesh-axis", _set(actor__mesh="foo=2"), r"unknown axis 'foo'"),
    ("rules", _set(actor__rules="megatron"), r"actor.rules='megatron': needs one of auto, train"),
    ("actor-lr", _set(actor__lr=-1.0), r"actor.lr=-1.0"),
    ("epochs", _set(actor__ppo_epochs=0), r"actor.ppo_epochs=0: needs an int >= 1"),
    ("mini", _set(actor__ppo_mini_batch_size=0), r"actor.ppo_mini_batch_size=0"),
    ("mini-big", _set(actor__ppo_mini_batch_size=256), r"ppo_mini_batch_size=256 prompts is "
     r"more than data.train_batch_size=128"),
    ("policy-loss", _set(actor__policy_loss="ppo"), r"actor.policy_loss='ppo': needs one of"),
    ("dual-clip", _set(actor__clip_ratio_c=0.5), r"clip_ratio_c=0.5: needs a float > 1"),
    ("agg", _set(actor__loss_agg_mode="mean"), r"loss_agg_mode='mean': needs one of"),
    ("kl-loss-type", _set(actor__kl_loss_type="kl9"), r"kl_loss_type='kl9'"),
    ("grad-clip", _set(actor__grad_clip=-1.0), r"grad_clip=-1.0"),
    ("temperature-neg", _set(rollout__temperature=-1.0), r"rollout.temperature=-1.0: needs a "
     r"float > 0"),
    ("temperature-zero", _set(rollout__temperature=0.0), r"rollout.temperature=0.0"),
    ("top-p-zero", _set(rollout__top_p=0.0), r"rollout.top_p=0.0: needs a float in \(0, 1\]"),
    ("top-p-big", _set(rollout__top_p=1.5), r"rollout.top_p=1.5"),
    ("top-k", _set(rollout__top_k=-1), r"rollout.top_k=-1"),
    ("min-p", _set(rollout__min_p=1.0), r"rollout.min_p=1.0: needs a float in \[0, 1\)"),
    ("samples", _set(rollout__n=0), r"rollout.n=0"),
    ("response", _set(rollout__response_length=0), r"rollout.response_length=0"),
    ("tool-unknown", _set(rollout__multi_turn__tools="calculator,abacus"),
     r"rollout.multi_turn.tools='calculator,abacus': unknown tool 'abacus'; known: calculator"),
    ("max-turns", _set(rollout__multi_turn__max_turns=0), r"rollout.multi_turn.max_turns=0: "
     r"needs an int >= 1"),
    ("parallel-calls", _set(rollout__multi_turn__max_parallel_calls=0),
     r"rollout.multi_turn.max_parallel_calls=0: needs an int >= 1"),
    ("python-isolation", _set(rollout__multi_turn__python_isolation="off"),
     r"rollout.multi_turn.python_isolation='off': needs one of jail, none"),
    ("val-n", _set(rollout__val_kwargs__n=0), r"rollout.val_kwargs.n=0: needs an int >= 1"),
    ("val-temperature", _set(rollout__val_kwargs__temperature=-0.5),
     r"rollout.val_kwargs.temperature=-0.5"),
    ("rollout-mesh", _set(rollout__mesh="tensor=x"), r"rollout.mesh='tensor=x'"),
    ("rollout-mode", _set(rollout__mode="paged"), r"rollout.mode='paged': needs one of static, "
     r"continuous"),
    ("rollout-slots", _set(rollout__slots=-4), r"rollout.slots=-4: needs an int >= 0"),
    ("refill-every", _set(rollout__refill_every=0), r"rollout.refill_every=0: needs an int >= 1"),
    ("slot-cache", _set(rollout__mode="continuous", rollout__max_cache_len=12),
     r"rollout.max_cache_len=12 cache columns per slot cannot hold a request of "
     r"data.max_prompt_length \+ rollout.response_length = \d+ tokens"),
    ("token-budget", _set(actor__use_remove_padding=True, actor__ppo_max_token_len_per_gpu=10),
     r"actor.ppo_max_token_len_per_gpu=10 tokens is smaller than one sequence "
     r"\(data.max_prompt_length \+ rollout.response_length = 18\)"),
    ("rm-budget", _set(reward_model__use_remove_padding=True,
                       reward_model__forward_max_token_len_per_gpu=12),
     r"reward_model.forward_max_token_len_per_gpu=12 tokens is smaller than one sequence "
     r"\(data.max_prompt_length \+ rollout.response_length = 18\); set "
     r"--config.reward_model.forward_max_token_len_per_gpu=18 or more, or 0 \(the whole "
     r"batch's tokens\)"),
    ("critic-budget", _set(critic__ppo_max_token_len_per_gpu=-1),
     r"critic.ppo_max_token_len_per_gpu=-1: needs an int >= 0"),
    ("cliprange", _set(critic__cliprange_value=0.0), r"critic.cliprange_value=0.0"),
    ("critic-micro", _set(critic__ppo_micro_batch_size=0), r"critic.ppo_micro_batch_size=0"),
    ("estimator", _set(algo__adv_estimator="gea"), r"algo.adv_estimator='gea': needs one of"),
    ("estimator-input", _set(algo__adv_estimator="remax"), r"adv_estimator='remax' needs "
     r"reward_baselines, which algorithm 'ppo' does not produce"),
    ("estimator-critic", _set(algorithm="grpo"), r"adv_estimator='gae' needs values, which "
     r"algorithm 'grpo' does not produce"),
    ("gamma", _set(algo__gamma=1.5), r"algo.gamma=1.5"),
    ("lam", _set(algo__lam=-0.1), r"algo.lam=-0.1"),
    ("kl-penalty", _set(algo__kl_penalty="kl9"), r"algo.kl_penalty='kl9'"),
    ("kl-ctrl", _set(algo__kl_ctrl__type="adaptiv"), r"algo.kl_ctrl.type='adaptiv': needs one "
     r"of adaptive, fixed"),
    ("target-kl", _set(algo__kl_ctrl__target_kl=0.0), r"algo.kl_ctrl.target_kl=0.0"),
    ("adaptive-unused", _set(algo__kl_ctrl__type="adaptive", algo__use_kl_in_reward=False),
     r"kl_ctrl.type='adaptive' adapts the KL-in-reward coefficient"),
    ("reward-file", _set(reward__custom_fn="/no/such.py:fn"), r"file /no/such.py does not "
     r"exist"),
    ("reward-spec", _set(reward__custom_fn="{hang_reward}"), r"must look like "
     r"path/to/file.py:function_name"),
    ("reward-name", _set(reward__custom_fn="{hang_reward}:1fn"), r"must look like"),
    ("reward-procs", _set(reward__num_processes=-1), r"reward.num_processes=-1"),
    ("reward-timeout", _set(reward__timeout_s=0.0), r"reward.timeout_s=0.0: needs a float > 0"),
    ("total-steps", _set(trainer__total_steps=-1), r"trainer.total_steps=-1: needs an int >= 0"),
    ("test-freq", _set(trainer__test_freq=-1), r"trainer.test_freq=-1"),
    ("logger", _set(trainer__logger="console,tensorbored"), r"unknown sink"),
    ("out-dir-empty", _set(trainer__out_dir=""), r"trainer.out_dir='': needs a directory"),
    ("out-dir-file", _set(trainer__out_dir="{file}"), r"is an existing file, not a directory"),
    ("keep", _set(trainer__max_to_keep=-1), r"trainer.max_to_keep=-1"),
    ("resume", _set(trainer__resume="/no/such/run"), r"not auto, disable or an existing "
     r"checkpoint directory"),
    ("nonfinite", _set(trainer__nonfinite="ignore"), r"trainer.nonfinite='ignore': needs one "
     r"of stop, skip"),
    ("cache-file", _set(trainer__compilation_cache_dir="{file}"), r"is a file; give a "
     r"directory, 'auto' or 'off'"),
    ("unknown-key", _do(lambda c: c.trainer.__setattr__("totl_steps", 5)),
     r"unknown config key trainer.totl_steps; did you mean trainer.total_steps"),
    ("missing-key", _do(lambda c: c.trainer.__delattr__("nonfinite")),
     r"the config has no key trainer.nonfinite"),
    ("chain-digits", _set(data__task="arith_chain", data__max_b=99),
     r"data.chain_steps=79 with data.max_b=99 runs the chain's sums past 999"),
    ("chain-carry", _set(data__task="arith_chain", sft__corruption="carry"),
     r"sft.corruption='carry' has no chain form; use 'format' or 'none'"),
    ("sft-schedule", _set(sft__lr_schedule="linear"),
     r"sft.lr_schedule.*needs one of constant, cosine"),
    ("images-text-model", _set(data__task="shapes", sft__steps=0),
     r"data.task='shapes' shows the policy pictures, and the model is text-only; set "
     r"--config.model.vision_depth \(e.g. 2\) or a Qwen2.5-VL model.path"),
    ("vision-lora", _set(model__vision_depth=2, actor__freeze_vision=False,
                         actor__lora__rank=4),
     r"actor.freeze_vision=False with actor.lora.rank > 0 trains no vision tower"),
    ("vision-mesh", _set(model__vision_depth=2, actor__mesh="fsdp=-1,tensor=4"),
     r"actor.mesh='fsdp=-1,tensor=4' splits the vision tower's heads 4 ways, which does not "
     r"divide its 2 heads"),
    ("vision-checkpoint-rows", _set(model__path="preset:qwen2.5-vl-3b",
                                    rollout__mode="continuous"),
     r"a vision-language policy: rows with images are built for padded rows and static "
     r"rollouts only; turn off rollout.mode='continuous'"),
    ("vision-rollout-pool", _set(model__vision_depth=2, actor__share_prompt=False,
                                 placement="gen=4:rollout;train=4:actor+ref+critic+reward",
                                 async_rollout__max_staleness=1),
     r"turn off a rollout pool of its own \(async_rollout\)"),
    ("vision-rows", _set(model__vision_depth=2, actor__use_remove_padding=True),
     r"rows with images are built for padded rows and static rollouts only; turn off "
     r"actor.use_remove_padding"),
    ("blank-text-model", _set(data__blank_images=True),
     r"data.blank_images=True blanks a vision-language policy's pictures, and "
     r"the model is text-only"),
    ("vision-checkpoint", _set(model__vision_depth=2, model__path="preset:qwen2.5-7b"),
     r"with model.path set .*set --config.model.vision_depth=0"),
]


# Every shipped launch.train config that reads no earlier run's output (those run in the smoke
# tier after the commands that write what they read). The algorithms the docs name only in
# passing (dapo, drgrpo, gspo, reinforce++, rloo, remax) run their steps in
# tests/algorithms/test_multi_turn_credit.py.
@pytest.mark.parametrize("name", [
    "dapo_arith", "drgrpo_arith", "grpo_arith", "grpo_long", "grpo_long_arith", "grpo_lora_arith",
    "grpo_lora_llama70b", "grpo_smollm2", "grpo_smollm2_arith", "grpo_smollm2_lora_arith",
    "grpo_shapes", "grpo_tool_arith", "gspo_arith", "ppo_arith", "ppo_llama8b", "ppo_tool_arith",
    "reinforce_plus_plus_arith", "reinforce_plus_plus_baseline_arith", "remax_arith",
    "rloo_arith"])
def test_shipped_configs_pass(files, name):
    import importlib

    c = importlib.import_module(f"configs.{name}").get_config()
    if c.data.task == "parquet":  # the data files are given on the command line
        c.data.train_files = c.data.val_files = files["parquet"]
    check_config(c)


# These rows check the message only: `check_config` and `check_flags` write nothing, and every
# exception `cli.report` words ends with the same status. What the process does (its exit
# status, the files it leaves alone) is checked on real processes below (SUBPROCESS).
@pytest.mark.parametrize("change,message", [c[1:] for c in CONFIG_CASES],
                         ids=[c[0] for c in CONFIG_CASES])
def test_bad_train_setting_is_one_line(files, change, message):
    c = ppo_arith.get_config()
    change(c, files)
    with pytest.raises(ValueError) as err:
        check_config(c)
    line, _ = cli.report("train", err.value)
    assert "\n" not in line and line.startswith("hfjax train: ")
    assert re.search(message, line), line


# -- the other entry points' flags -----------------------------------------------------------

_GENERATE = dict(model=None, prompt=["What is 7 + 5?"], max_new_tokens=64, temperature=1.0,
                 top_k=0, top_p=1.0, min_p=0.0, n=1, seed=0, mesh=None,
                 compilation_cache_dir="auto")

FLAG_CASES = [
    ("generate", dict(temperature=-1.0), r"--temperature=-1.0: needs a float >= 0"),
    ("generate", dict(top_p=0.0), r"--top_p=0.0: needs a float in \(0, 1\]"),
    ("generate", dict(top_p=2.0), r"--top_p=2.0"),
    ("generate", dict(min_p=1.0), r"--min_p=1.0: needs a float in \[0, 1\)"),
    ("generate", dict(top_k=-3), r"--top_k=-3: needs an int >= 0"),
    ("generate", dict(n=0), r"--n=0: needs an int >= 1"),
    ("generate", dict(max_new_tokens=0), r"--max_new_tokens=0"),
    ("generate", dict(seed=-1), r"--seed=-1"),
    ("generate", dict(prompt=[""]), r"--prompt='': needs at least one non-empty prompt"),
    ("generate", dict(model="/no/such/dir"), r"--model=/no/such/dir: no such file"),
    ("generate", dict(model="{file}"), r"is a file but not a .gguf"),
    ("generate", dict(mesh="foo=2"), r"--mesh=foo=2: .*unknown axis 'foo'"),
    ("generate", dict(compilation_cache_dir="{file}"), r"--compilation_cache_dir=.*is a file"),
    ("convert", dict(src="/no/such", dst="{root}/out"), r"--src=/no/such: no such file"),
    ("convert", dict(src="{hf}", dst="{hf}"), r"--dst=.*would replace the source model"),
    ("convert", dict(src="{hf}", dst="{root}"), r"would replace the source model"),
    ("convert", dict(src="{hf}", dst="{file}"), r"is an existing file, not a directory"),
    ("convert", dict(src="{hf}", dst="{stuff}"), r"non-empty directory that holds no HF model"),
    ("convert", dict(src="{no_config}", dst="{root}/out"), r"has no config.json"),
    ("export", dict(ckpt="/no/such", out="{root}/out", step=None, tokenizer=None),
     r"--ckpt=/no/such: no such directory"),
    ("export", dict(ckpt="{run}", out="{run}", step=None, tokenizer=None),
     r"would replace the run directory"),
    ("export", dict(ckpt="{run}/checkpoints/2", out="{run}/checkpoints/hf", step=None,
                    tokenizer=None), r"would replace the run directory"),
    ("export", dict(ckpt="{run}", out="{root}/out", step=-1, tokenizer=None),
     r"--step=-1: needs an int >= 0"),
    ("export", dict(ckpt="{run}", out="{root}/out", step=None, tokenizer="/no/tok"),
     r"--tokenizer=/no/tok: no such tokenizer"),
    ("export", dict(ckpt="{run}", out="{stuff}", step=None, tokenizer=None),
     r"non-empty directory that holds no HF model"),
    ("evaluate", dict(model="/no/such"), r"--model=/no/such: no such file or directory"),
    ("evaluate", dict(model="{stuff}"), r"is neither an HF model directory .* nor a training run"),
    ("evaluate", dict(model="{hf}", step=3), r"--step=3 picks a checkpoint, but --model is not"),
    ("evaluate", dict(model="{run}", step=-1), r"--step=-1: needs an int >= 0"),
    ("evaluate", dict(data="{root}/no.parquet"), r"--data=.*no.parquet: no such file"),
    ("evaluate", dict(samples=0), r"--samples=0: needs an int >= 1"),
    ("evaluate", dict(temperature=0.0), r"--temperature=0.0: needs a float > 0"),
    ("evaluate", dict(limit=-2), r"--limit=-2: needs an int >= 0"),
    ("prepare_data", dict(n_train=-1, n_test=10, out="{root}/d", seed=0, task_config="{{}}"),
     r"--n_train=-1: needs an int >= 0"),
    ("prepare_data", dict(n_train=0, n_test=0, out="{root}/d", seed=0, task_config="{{}}"),
     r"ask for no rows"),
    ("prepare_data", dict(n_train=5, n_test=5, out="{root}/d", seed=0, task_config="{{bad"),
     r"--task_config=\{bad: is not JSON"),
    ("prepare_data", dict(n_train=5, n_test=5, out="{root}/d", seed=0, task_config="[1]"),
     r"needs a JSON object"),
    ("prepare_data", dict(n_train=5, n_test=5, out="{file}", seed=0, task_config="{{}}"),
     r"--out=.*is an existing file"),
    ("prepare_data", dict(n_train=5, n_test=5, out="{root}/d", seed=0, task_config="{{}}",
                          tools="abacus"), r"--tools=abacus: unknown tool 'abacus'; known: "),
    ("train", dict(cpu_devices=-1), r"--cpu_devices=-1: needs an int >= 0"),
]


@pytest.mark.parametrize("entry,values,message", FLAG_CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(FLAG_CASES)])
def test_bad_flag_is_one_line(files, entry, values, message):
    values = {k: v.format(**files) if isinstance(v, str) else v for k, v in values.items()}
    if entry == "generate":
        values = {**_GENERATE, **values}
    with pytest.raises(ValueError) as err:
        check_flags(entry, values)
    line, _ = cli.report(entry, err.value)
    assert "\n" not in line and line.startswith(f"hfjax {entry}: ")
    assert re.search(message, line), line


# -- damaged files -------------------------------------------------------------------------------

FILE_CASES = [
    ("gguf-truncated", lambda f: M.load(f["trunc_gguf"]), r"is a truncated or damaged GGUF"),
    ("gguf-truncated-tokenizer", lambda f: M.load_tokenizer(f["trunc_gguf"]),
     r"is a truncated or damaged GGUF"),
    ("gguf-text", lambda f: M.load(f["text_gguf"]), r"is not a GGUF file"),
    ("gguf-empty", lambda f: M.load_tokenizer(f["empty_gguf"]), r"is not a GGUF file"),
    ("safetensors-truncated", lambda f: M.load(f["st_trunc"]),
     r"model.safetensors is truncated"),
    ("safetensors-text", lambda f: M.load(f["st_text"]), r"is not a safetensors file"),
    ("config-json", lambda f: M.load(f["cfg_json"]), r"config.json is not valid JSON"),
    ("tokenizer-json", lambda f: M.load_tokenizer(f["tok_json"]),
     r"tokenizer.json is damaged or not a tokenizers file"),
    ("parquet-text", lambda f: Dataset.from_parquet(f["text_parquet"], arith.tokenizer(), 8),
     r"cannot read parquet file"),
    ("parquet-columns", lambda f: Dataset.from_parquet(f["cols_parquet"], arith.tokenizer(), 8),
     r"missing column\(s\) .*reward_model"),
    ("checkpoints-corrupt", lambda f: _restore(f["run_corrupt"]),
     r"every checkpoint in .* is corrupt .*move the directory aside .*trainer.out_dir="),
    ("metrics-line", lambda f: metrics.read_jsonl(os.path.join(f["run_badjsonl"],
                                                                "metrics.jsonl")),
     r"line 2 is damaged .*move .* aside"),
]


def _restore(run):
    from hfjax.run.export import load_actor

    return load_actor(run)


@pytest.mark.parametrize("load,message", [c[1:] for c in FILE_CASES],
                         ids=[c[0] for c in FILE_CASES])
def test_damaged_file_is_one_line_and_left_alone(files, load, message, caplog):
    before = _tree(files["root"])
    with pytest.raises((ValueError, CheckpointCorrupt)) as err:
        load(files)
    line, _ = cli.report("generate", err.value)
    assert "\n" not in line and "internal error" not in line
    assert re.search(message, line), line
    assert _tree(files["root"]) == before  # a reader that opened a damaged file wrote nothing
    # A fallback that found nothing readable says so once, in the error, not in warnings too.
    assert not [r for r in caplog.records if "falling back" in r.getMessage()]


# -- the real commands ----------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    entry: str
    args: list[str]
    message: str
    watch: tuple[str, ...] = ()  # inputs that must be left as they were
    absent: tuple[str, ...] = ()  # outputs that must not appear
    status: int = cli.EXIT_ERROR  # EXIT_USAGE: a flag that does not parse


_TINY = ["--config.data.n_train=64", "--config.data.n_test=8", "--config.data.train_batch_size=16",
         "--config.actor.ppo_mini_batch_size=8", "--config.critic.ppo_mini_batch_size=8",
         "--config.actor.ppo_micro_batch_size=8", "--config.critic.ppo_micro_batch_size=8",
         "--config.sft.steps=0"]

SUBPROCESS = [
    Case("train", ["--config.foo.bar=1", "--config.trainer.out_dir={root}/t1"],
         r"--config.foo.bar: the config .*ppo_arith.py has no such key", absent=("{root}/t1",),
         status=cli.EXIT_USAGE),
    Case("train", ["--config.trainer.totl_steps=3", "--config.trainer.out_dir={root}/t6"],
         r"did you mean --config.trainer.total_steps", absent=("{root}/t6",),
         status=cli.EXIT_USAGE),
    Case("train", ["--config={root}/missing.py"], r"--config=.*missing.py: no such config file",
         status=cli.EXIT_USAGE),
    Case("train", ["--cpu_devices=-1", "--config.trainer.out_dir={root}/t2"],
         r"--cpu_devices=-1: needs an int >= 0", absent=("{root}/t2",)),
    Case("train", ["--config.actor.lr=abc", "--config.trainer.out_dir={root}/t7"],
         r"--config.actor.lr=abc", absent=("{root}/t7",), status=cli.EXIT_USAGE),
    Case("train", ["--config.rollout.top_p=1.5", "--config.trainer.out_dir={root}/t3"],
         r"rollout.top_p=1.5: needs a float in \(0, 1\]", absent=("{root}/t3",)),
    Case("train", ["--config=configs/grpo_arith.py", "--config.trainer.out_dir={run}"],
         r"was saved by a 'ppo' run and this config runs 'grpo'", watch=("{run}",)),
    Case("train", ["--config.trainer.out_dir={run_badjsonl}"], r"line 2 is damaged",
         watch=("{run_badjsonl}",)),
    Case("train", ["--config.trainer.out_dir={root}/t4", "--config.reward.custom_fn="
                   "{hang_reward}:fn", "--config.reward.timeout_s=1", *_TINY],
         r"reward.custom_fn .*hang_reward.py:fn.*importing it took longer than 1 s",
         watch=("{hang_reward}",), absent=("{root}/t4",)),
    Case("train", ["stray", "--config.trainer.out_dir={root}/t8"],
         r"unexpected argument 'stray'", absent=("{root}/t8",)),
    # Across processes and devices (docs/scaling.md), each before anything compiles or is written.
    Case("train", ["--coordinator_address=127.0.0.1:1", "--num_processes=2", "--process_id=2",
                   "--config.trainer.out_dir={root}/d1"],
         r"--process_id=2 is out of range for --num_processes=2; process ids are 0\.\.1",
         absent=("{root}/d1",)),
    Case("train", ["--coordinator_address=127.0.0.1:1", "--num_processes=2", "--process_id=1",
                   "--coordinator_timeout_s=2", "--config.trainer.out_dir={root}/d2"],
         r"cannot reach the coordinator at 127.0.0.1:1 within 2 s \(--coordinator_timeout_s",
         absent=("{root}/d2",)),
    Case("train", ["--cpu_devices=2", "--config.actor.mesh=fsdp=4",
                   "--config.trainer.out_dir={root}/d3"],
         r"config.actor.mesh 'fsdp=4' needs 4 devices, the run has 2 cpu devices",
         absent=("{root}/d3",)),
    Case("train", ["--target=h300", "--config.trainer.out_dir={root}/d4"],
         r"--target=h300: unknown target 'h300'; known targets: h100, h200",
         absent=("{root}/d4",)),
    Case("train", ["--config.model.path=preset:llama9", "--config.trainer.out_dir={root}/d5"],
         r"model.path='preset:llama9': unknown model preset 'llama9'; known: .*llama3.1-8b",
         absent=("{root}/d5",)),
    Case("sft", ["--cpu_devices=-1", "--config.trainer.out_dir={root}/s1"],
         r"--cpu_devices=-1: needs an int >= 0", absent=("{root}/s1",)),
    Case("sft", ["--config.sft.stpes=3", "--config.trainer.out_dir={root}/s3"],
         r"did you mean --config.sft.steps", absent=("{root}/s3",), status=cli.EXIT_USAGE),
    Case("sft", ["--cpu_devices=2", "--config.actor.mesh=fsdp=4",
                 "--config.trainer.out_dir={root}/s4"],
         r"config.actor.mesh 'fsdp=4' needs 4 devices, the run has 2 cpu devices",
         absent=("{root}/s4",)),
    Case("sft", ["--config.sft.train_files={root}/none.parquet",
                 "--config.trainer.out_dir={root}/s2"],
         r"sft.train_files=.*none.parquet.*no such file", absent=("{root}/s2",)),
    Case("train_rm", ["--config.model.path=", "--config.rm.train_files={prefs_no_rejected}",
                      "--config.rm.val_files=", "--config.trainer.out_dir={root}/r1"],
         r"missing column\(s\) rejected", watch=("{prefs_no_rejected}",),
         absent=("{root}/r1",)),
    Case("train_rm", ["--config.model.path=", "--config.rm.target=safety",
                      "--config.trainer.out_dir={root}/r2"],
         r"rm.target='safety': needs one of reward, cost", absent=("{root}/r2",)),
    Case("train_dpo", ["--config.dpo.loss_type=kto", "--config.trainer.out_dir={root}/o1"],
         r"dpo.loss_type='kto': needs one of ipo, sigmoid, simpo", absent=("{root}/o1",)),
    Case("train", ["--config.reward_model.path={hf}", "--config.trainer.out_dir={root}/t5"],
         r"reward_model.path=.* has no score head", watch=("{hf}",), absent=("{root}/t5",)),
    Case("generate", ["--temperature=-1"], r"--temperature=-1.0: needs a float >= 0"),
    Case("generate", ["--model={trunc_gguf}"], r"truncated or damaged GGUF file",
         watch=("{trunc_gguf}",)),
    Case("generate", ["--model={text_gguf}"], r"is not a GGUF file", watch=("{text_gguf}",)),
    Case("generate", ["--model={st_trunc}"], r"model.safetensors is truncated",
         watch=("{st_trunc}",)),
    Case("convert", ["--src={hf}", "--dst={hf}"], r"would replace the source model",
         watch=("{hf}",)),
    Case("convert", ["--src={st_text}", "--dst={root}/c1"], r"is not a safetensors file",
         watch=("{st_text}",), absent=("{root}/c1",)),
    Case("convert", ["--dst={root}/c2"], r"--src is required", absent=("{root}/c2",),
         status=cli.EXIT_USAGE),
    Case("export", ["--ckpt={run}", "--out={run}"], r"would replace the run directory",
         watch=("{run}",)),
    Case("export", ["--ckpt={run_corrupt}", "--out={root}/e1"],
         r"every checkpoint in .* is corrupt", watch=("{run_corrupt}",), absent=("{root}/e1",)),
    Case("export", ["--ckpt={root}/nothing", "--out={root}/e2"], r"no such directory",
         absent=("{root}/e2",)),
    Case("evaluate", ["--model={hf}", "--samples=0"], r"--samples=0: needs an int >= 1"),
    Case("evaluate", ["--model={stuff}"], r"is neither an HF model directory",
         watch=("{stuff}",)),
    Case("evaluate", ["--model={run_corrupt}"], r"every checkpoint in .* is corrupt",
         watch=("{run_corrupt}",)),
    Case("prepare_data", ["--task=arith", "--out={root}/p1", "--task_config={{bad"],
         r"--task_config=\{{bad: is not JSON", absent=("{root}/p1",)),
    Case("prepare_data", ["--task=gsm", "--out={root}/p2"], r"--task=gsm: value should be one of",
         absent=("{root}/p2",), status=cli.EXIT_USAGE),
    Case("prepare_data", ["--task=countdown", "--out={root}/p3", "--n_train=4", "--n_test=2",
                          '--task_config={{"no_such_option": 1}}'],
         r"task config .* for 'countdown'.*no_such_option", absent=("{root}/p3",)),
]


# The entry point of each case, each named whole so that the Bazel build ships it with this
# test (scripts/bazel_build.py makes a launch/ module named in a string a test's data).
ENTRY_MODULES = {"train": "launch.train", "sft": "launch.sft", "train_rm": "launch.train_rm",
                 "train_dpo": "launch.train_dpo", "generate": "launch.generate",
                 "convert": "launch.convert", "export": "launch.export",
                 "prepare_data": "launch.prepare_data", "evaluate": "launch.evaluate"}


def _run_case(case: Case, files, env) -> tuple[subprocess.CompletedProcess, dict, dict]:
    args = [a.format(**files) for a in case.args]
    watch = [w.format(**files) for w in case.watch]
    before = {w: _tree(w) for w in watch}
    p = subprocess.run([sys.executable, "-m", ENTRY_MODULES[case.entry], *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    return p, before, {w: _tree(w) for w in watch}


@pytest.fixture(scope="module")
def ran(files, tmp_path_factory):
    """Every SUBPROCESS case, run a few at a time: {index: (process, before, after)}."""
    env = subprocess_env(tmp_path_factory.mktemp("xla_cache"))  # some cases stop runs midway
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = {i: pool.submit(_run_case, c, files, env) for i, c in enumerate(SUBPROCESS)}
        return {i: f.result() for i, f in futures.items()}


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(SUBPROCESS)),
                         ids=[f"{c.entry}-{i}" for i, c in enumerate(SUBPROCESS)])
def test_entry_point_ends_with_one_line(ran, files, index):
    case = SUBPROCESS[index]
    p, before, after = ran[index]
    lines = [line for line in (p.stdout + p.stderr).splitlines() if line.strip()]
    assert p.returncode == case.status, (p.returncode, lines)
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"hfjax {case.entry}: "), lines
    assert "Traceback" not in lines[0]
    assert re.search(case.message.format(**files), lines[0]), lines[0]
    assert after == before
    for path in case.absent:
        assert not os.path.exists(path.format(**files)), path


def test_case_count():
    """The acceptance table: at least 60 bad settings and damaged inputs, every entry point."""
    total = len(CONFIG_CASES) + len(FLAG_CASES) + len(FILE_CASES) + len(SUBPROCESS)
    assert total >= 60, total
    entries = {c[0] for c in FLAG_CASES} | {c.entry for c in SUBPROCESS} | {"train"}
    assert entries == {"train", "sft", "train_rm", "train_dpo", "generate", "convert",
                       "export", "prepare_data", "evaluate"}


def test_verbose_shows_the_traceback(tmp_path):
    env = subprocess_env()
    p = subprocess.run([sys.executable, "-m", "launch.export", f"--ckpt={tmp_path}/none",
                        f"--out={tmp_path}/out", "--verbose"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and "Traceback" in p.stderr


@pytest.mark.slow
def test_a_fallback_warns_once_per_corrupt_step_and_nothing_else(files, tmp_path):
    """A corrupt newest checkpoint with a readable one before it: the command succeeds, with one
    warning naming the corrupt step and none of the late callbacks of the abandoned restore
    ("RuntimeError: Event loop is closed")."""
    env = subprocess_env()
    p = subprocess.run([sys.executable, "-m", "launch.export", f"--ckpt={files['run_fallback']}",
                        f"--out={tmp_path}/hf"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    warnings = [line for line in p.stderr.splitlines() if "falling back" in line]
    assert len(warnings) == 1 and "checkpoints/2 is corrupt" in warnings[0], p.stderr
    assert "Event loop is closed" not in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert (tmp_path / "hf" / "model.safetensors").is_file()

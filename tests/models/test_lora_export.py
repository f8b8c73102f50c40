"""A LoRA run's export, through `python -m launch.export` as a user runs it: `--format=peft`
loads with `peft.PeftModel.from_pretrained` onto the transformers base and gives hfjax's
logits within 1e-4; `--format=merged` (here called in-process, `export_hf`) is a full HF
directory with the same logits.

The run starts from a tiny Llama that transformers builds and saves here (so the base is named
by its path, not saved), and its adapters are set to random values before the checkpoint, so
that they change the logits well beyond the tolerance."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hf_fixtures import make_hf_model
from support import ROOT, subprocess_env, tiny_rl_config

from hfjax.data import arith
from hfjax.run.checkpoint import RunCheckpointer, export_hf
from hfjax.run.trainer import Trainer

pytestmark = pytest.mark.slow


def _export(run, out, fmt, env):
    p = subprocess.run([sys.executable, "-m", "launch.export", f"--ckpt={run}", f"--out={out}",
                        f"--format={fmt}"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return p


def test_peft_and_merged_exports_give_hfjax_logits(tmp_path):
    import peft
    import transformers as tf

    base_dir = str(tmp_path / "base")
    make_hf_model("llama", base_dir)
    arith.tokenizer().save(base_dir)  # the embedded task's tokens (18, within the 128)
    c = tiny_rl_config(algorithm="grpo", out_dir=tmp_path / "run")
    c.model.path = base_dir
    c.model.dtype = "float32"
    c.actor.use_kl_loss = True
    c.algo.adv_estimator = "grpo"
    c.algo.use_kl_in_reward = False
    c.rollout.n = 2
    c.actor.lora.rank, c.actor.lora.alpha = 4, 8.0
    c.actor.lora.targets = "q_proj,v_proj,o_proj,down_proj"
    c.actor.lora.dropout = 0.1  # training only: the exports and PEFT in eval mode have none
    t = Trainer(c)
    w = t.workers
    # Random adapters (B starts at zero: the adapted model would equal the base).
    rng = np.random.default_rng(0)
    with jax.transfer_guard("allow"):
        layers = w.actor.params["model"]["layers"]
        for k in list(layers.keys()):
            if k.endswith("_lora_b"):
                v = layers[k].get_value()
                layers[k].set_value(jax.device_put(
                    jnp.asarray(0.2 * rng.standard_normal(v.shape), v.dtype), v.sharding))
    ckpt = RunCheckpointer(str(tmp_path / "run" / "checkpoints"), async_save=False)
    t.save(ckpt)
    ckpt.close()
    t._save_tokenizer(str(tmp_path / "run"))

    ids = np.random.default_rng(1).integers(0, 128, (2, 9)).astype(np.int32)
    with jax.transfer_guard("allow"):
        want = np.asarray(w.actor.model()(jnp.asarray(ids)))
        base_logits = np.asarray(w.ref.model(w.ref.params)(jnp.asarray(ids)))
    assert np.abs(want - base_logits).max() > 1e-2  # the adapters matter

    env = subprocess_env()
    _export(tmp_path / "run", tmp_path / "adapter", "peft", env)
    cfg = json.load(open(tmp_path / "adapter" / "adapter_config.json"))
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8.0 and cfg["base_model_name_or_path"] == \
        base_dir and sorted(cfg["target_modules"]) == ["down_proj", "o_proj", "q_proj", "v_proj"]
    assert cfg["lora_dropout"] == 0.1
    assert not os.path.exists(tmp_path / "adapter" / "base")  # named by its path, not copied
    model = peft.PeftModel.from_pretrained(
        tf.AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32),
        str(tmp_path / "adapter"))
    model.eval()
    with torch.no_grad():
        got = model(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)

    export_hf(str(tmp_path / "run"), str(tmp_path / "merged"), fmt="merged")  # in-process
    merged = tf.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"),
                                                     torch_dtype=torch.float32)
    merged.eval()
    with torch.no_grad():
        got = merged(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)

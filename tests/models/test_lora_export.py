"""A LoRA run's export, through `python -m launch.export` as a user runs it: `--format=peft`
loads with PEFT's one-liner (`AutoPeftModelForCausalLM.from_pretrained(adapter_dir)`) for an HF
directory, GGUF or preset base, without key warnings, and gives hfjax's logits within 1e-4;
`--format=merged` (here called in-process, `export_hf`) is a full HF directory with the same
logits; either format replaces an earlier export in the same --out.

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
from hfjax.run.checkpoint import RunCheckpointer
from hfjax.run.export import export_hf
from hfjax.run.trainer import Trainer

pytestmark = pytest.mark.slow


def _export(run, out, fmt, env):
    p = subprocess.run([sys.executable, "-m", "launch.export", f"--ckpt={run}", f"--out={out}",
                        f"--format={fmt}"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return p


def _lora_run(tmp_path, model_path, tokenizer=""):
    """A LoRA GRPO run from `model_path` with random adapters, checkpointed at step 0 in
    tmp_path/run; returns (token ids, hfjax's float32 logits of the adapted model on them)."""
    c = tiny_rl_config(algorithm="grpo", out_dir=tmp_path / "run")
    c.model.path = model_path
    c.model.tokenizer = tokenizer
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
    return ids, want


def test_peft_and_merged_exports_give_hfjax_logits(tmp_path):
    import transformers as tf

    base_dir = str(tmp_path / "base")
    make_hf_model("llama", base_dir)
    arith.tokenizer().save(base_dir)  # the embedded task's tokens (18, within the 128)
    ids, want = _lora_run(tmp_path, base_dir)

    env = subprocess_env()
    _export(tmp_path / "run", tmp_path / "adapter", "peft", env)
    cfg = json.load(open(tmp_path / "adapter" / "adapter_config.json"))
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8.0 and cfg["base_model_name_or_path"] == \
        base_dir and sorted(cfg["target_modules"]) == ["down_proj", "o_proj", "q_proj", "v_proj"]
    assert cfg["lora_dropout"] == 0.1
    assert not os.path.exists(tmp_path / "adapter" / "base")  # named by its path, not copied
    model, said = _peft_load_quietly(tmp_path / "adapter")  # PEFT's one-liner
    assert not _key_warnings(said), said
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


def _peft_load_quietly(adapter_dir):
    """AutoPeftModelForCausalLM.from_pretrained(adapter_dir), PEFT's one-liner, in eval mode;
    with the warnings and the transformers/PEFT log lines it gave."""
    import logging
    import warnings

    import peft
    import transformers as tf

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    loggers = [logging.getLogger(n) for n in ("transformers", "peft")]
    for lg in loggers:
        lg.addHandler(handler)
    tf.utils.logging.set_verbosity_warning()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = peft.AutoPeftModelForCausalLM.from_pretrained(
                str(adapter_dir), torch_dtype=torch.float32)
    finally:
        for lg in loggers:
            lg.removeHandler(handler)
    model.eval()
    said = [str(w.message) for w in caught] + [r.getMessage() for r in records]
    return model, said


def _key_warnings(said):
    words = ("missing", "unexpected", "not initialized", "newly initialized", "key")
    return [s for s in said if any(w in s.lower() for w in words)]


@pytest.mark.parametrize("kind", ["gguf", "preset"])
def test_peft_export_of_a_base_that_is_no_hf_directory_loads_by_name(tmp_path, kind):
    """A GGUF-based or preset-based LoRA run: the adapter loads with PEFT's one-liner (its base
    written once as an HF directory beside it) and gives hfjax's logits within 1e-4 without key
    warnings; (GGUF) re-exporting to the same --out replaces the earlier export in either
    format."""
    from hf_fixtures import make_tiny_gguf

    from hfjax.config import check_flags

    if kind == "gguf":
        tok_dir = str(tmp_path / "tok")
        arith.tokenizer().save(tok_dir)
        ids, want = _lora_run(tmp_path, make_tiny_gguf(tmp_path / "tiny.gguf"), tok_dir)
    else:
        ids, want = _lora_run(tmp_path, "preset:tiny")
    out = tmp_path / "adapter"
    env = subprocess_env()
    _export(tmp_path / "run", out, "peft", env)
    cfg = json.load(open(out / "adapter_config.json"))
    assert cfg["base_model_name_or_path"] == str(out / "base")
    assert os.path.isfile(out / "base" / "config.json")

    model, said = _peft_load_quietly(out)
    assert not _key_warnings(said), said
    with torch.no_grad():
        got = model(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    if kind == "preset":
        return
    # The warning capture is not blind: with an adapter tensor dropped, PEFT's missing-key
    # warning is caught.
    from safetensors.numpy import load_file, save_file

    tensors = load_file(out / "adapter_model.safetensors")
    del tensors[sorted(tensors)[0]]
    save_file(tensors, out / "adapter_model.safetensors", {"format": "pt"})
    assert _key_warnings(_peft_load_quietly(out)[1])

    # The same --out again, as a user reruns the command: the earlier export is replaced.
    (out / "stale.txt").write_text("from the first export")
    _export(tmp_path / "run", out, "peft", env)
    assert not os.path.exists(out / "stale.txt") and os.path.isfile(out / "adapter_config.json")
    # Then as a merged model, and back: either format replaces the other.
    for fmt, marker, gone in (("merged", "config.json", "adapter_config.json"),
                              ("peft", "adapter_config.json", "model.safetensors")):
        values = {"ckpt": str(tmp_path / "run"), "out": str(out), "format": fmt}
        check_flags("export", values)  # the rule launch.export applies first
        export_hf(str(tmp_path / "run"), str(out), fmt=fmt)
        assert os.path.isfile(out / marker) and not os.path.exists(out / gone)
    # A directory that holds neither is still refused.
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="holds no HF model or PEFT adapter"):
        check_flags("export", {"ckpt": str(tmp_path / "run"), "out": str(tmp_path / "other"),
                               "format": "peft"})

"""Writes the actor of a training run's checkpoint as an HF directory.

    python -m launch.export --ckpt=runs/ppo_arith --out=runs/ppo_arith/hf
    python -m launch.export --ckpt=runs/ppo_arith/checkpoints/40 --out=/tmp/step40

`--ckpt` is a run's out_dir, its checkpoint root, or one step directory; without a step the
newest readable checkpoint is used. The output (config.json, model.safetensors and the run's
tokenizer files) loads with `transformers.AutoModelForCausalLM.from_pretrained(out)`. `--out`
may be a new or empty directory or an earlier export (it is replaced), never the run itself.
"""

import os

from absl import flags

from launch import cli

_CKPT = flags.DEFINE_string("ckpt", None, "run out_dir, checkpoint root or step dir",
                            required=True)
_OUT = flags.DEFINE_string("out", None, "output HF directory", required=True)
_STEP = flags.DEFINE_integer("step", None, "checkpoint step (default: the newest readable)")
_TOKENIZER = flags.DEFINE_string(
    "tokenizer", None, "tokenizer directory or .gguf (default: the run's <out_dir>/tokenizer)")


def load_actor(ckpt: str, step: int | None = None):
    """(actor model on one device, Restored) from a checkpoint, newest readable by default."""
    import jax
    from flax import nnx

    from hfjax.checkpoint import RunCheckpointer, locate
    from hfjax.models import transformer
    from hfjax.models.config import ModelConfig

    root, at = locate(ckpt)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    graphdefs = {}

    def targets(state):
        cfg = ModelConfig(**state["model_config"])
        graphdef, abstract = nnx.split(transformer.abstract(cfg, "causal_lm"))
        graphdefs["actor"] = graphdef
        return {"actor_params": jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), abstract)}

    restored = RunCheckpointer(root, read_only=True).restore_latest(
        targets, step=step if step is not None else at)
    return nnx.merge(graphdefs["actor"], restored.items["actor_params"]), restored


def export(ckpt: str, out: str, step: int | None = None, tokenizer: str | None = None) -> str:
    """Writes the checkpoint's actor to `out` as an HF directory; returns out."""
    import hfjax.models as M
    from hfjax.checkpoint import locate

    model, _ = load_actor(ckpt, step)
    root, _ = locate(ckpt)
    tok_path = tokenizer or os.path.join(os.path.dirname(root), "tokenizer")
    if not os.path.exists(tok_path):
        raise FileNotFoundError(f"no tokenizer at {tok_path}; pass --tokenizer=DIR")
    return M.save_hf(model, out, tokenizer=M.load_tokenizer(tok_path))


def main(argv):
    del argv
    from hfjax import run_config

    run_config.check_flags("export", {k: flags.FLAGS[k].value
                                      for k in run_config.FLAG_KEYS["export"]})
    out = export(_CKPT.value, _OUT.value, _STEP.value, _TOKENIZER.value)
    print(f"wrote {out}")


if __name__ == "__main__":
    cli.run(main, "export", compilation_cache=True)

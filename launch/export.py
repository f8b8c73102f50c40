"""Writes the actor of a training run's checkpoint as an HF directory, or a LoRA run's
adapters in PEFT's format.

    python -m launch.export --ckpt=runs/ppo_arith --out=runs/ppo_arith/hf
    python -m launch.export --ckpt=runs/ppo_arith/checkpoints/40 --out=/tmp/step40
    python -m launch.export --ckpt=runs/grpo_lora_arith --out=/tmp/adapter --format=peft

`--format=merged` (the default; `hf` is the same) writes the full model, a LoRA run's adapters
merged into its weights; `--format=peft` writes adapter_config.json and
adapter_model.safetensors, which `peft.PeftModel.from_pretrained(base, DIR)` loads onto the
base model (named by its path, or written to DIR/base when the run made it).

`--ckpt` is a run's out_dir, its checkpoint root, or one step directory; without a step the
newest readable checkpoint is used. The output (config.json, model.safetensors and the run's
tokenizer files) loads with `transformers.AutoModelForCausalLM.from_pretrained(out)`. `--out`
may be a new or empty directory or an earlier export (it is replaced), never the run itself.

Across processes (the process flags of docs/scaling.md, or `launch.local_cluster --module=
launch.export`), every process restores its shards of the actor, sharded over the devices of
all processes, the tensors are gathered one layer at a time and process 0 writes the directory.
"""

from absl import flags

from hfjax.parallel import distributed
from launch import cli

_CKPT = flags.DEFINE_string("ckpt", None, "run out_dir, checkpoint root or step dir",
                            required=True)
_OUT = flags.DEFINE_string("out", None, "output HF directory", required=True)
_STEP = flags.DEFINE_integer("step", None, "checkpoint step (default: the newest readable)")
_TOKENIZER = flags.DEFINE_string(
    "tokenizer", None, "tokenizer directory or .gguf (default: the run's <out_dir>/tokenizer)")
_FORMAT = flags.DEFINE_string("format", "merged", "merged (or hf): a full HF directory; "
                              "peft: a LoRA run's adapters in PEFT's format")
distributed.define_flags()


def main(argv):
    del argv
    topo = distributed.initialize_from_flags()
    from hfjax.run.export import export_hf

    out = export_hf(_CKPT.value, _OUT.value, _STEP.value, _TOKENIZER.value, _FORMAT.value)
    if topo.process_id == 0:
        print(f"wrote {out}")


if __name__ == "__main__":
    cli.run(main, "export", compilation_cache=True)

"""Converts a GGUF file or an HF directory into an HF safetensors directory.

    python -m launch.convert --src=path/to/model.gguf --dst=out_dir

The output holds config.json, model.safetensors and the tokenizer files, and loads in
transformers with `AutoModelForCausalLM.from_pretrained(out_dir)`. `--dst` may be a new or
empty directory or an earlier conversion (it is replaced), never the source.
"""

from absl import flags

from launch import cli

_SRC = flags.DEFINE_string("src", None, "a .gguf file or an HF model directory", required=True)
_DST = flags.DEFINE_string("dst", None, "output HF directory", required=True)
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "weights dtype")


def main(argv):
    del argv
    import hfjax.models as M

    model = M.load(_SRC.value, dtype=_DTYPE.value)
    tok = M.load_tokenizer(_SRC.value)
    out = M.save_hf(model, _DST.value, tokenizer=tok)
    n = model.config.num_params()
    print(f"wrote {out}: {model.config.model_type}, {n / 1e6:.1f}M parameters, {_DTYPE.value}")


if __name__ == "__main__":
    cli.run(main, "convert", compilation_cache=True)

"""Held-out accuracy of a policy by generation: greedy, and pass@k with sampling.

    python -m launch.evaluate --model=runs/grpo_smollm2 --data=data/gsm/test.parquet \\
        --config=configs/grpo_smollm2.py
    python -m launch.evaluate --model=path/to/hf_dir --data=test.parquet --samples=8

`--model` is an HF directory, a `.gguf` file, or a training run (its out_dir, checkpoint root or
one step directory): a run's newest readable checkpoint (or `--step`) is evaluated with the
run's tokenizer. `--data` is RL parquet in verl's schema (what `launch.prepare_data` writes);
each row is scored by its data_source's rule reward, as in training. Without `--data`, the
config's validation files (`data.val_files`) are used, or for the embedded arithmetic task its
held-out prompts. The config (`--config`, default
configs/ppo_arith.py, any key overridable with `--config.KEY=VALUE`) sets the prompt and
response lengths, the actor's mesh, the compute precision and the reward settings, so a run is
evaluated with the settings it trained with by passing its own config.

Printed per data source: greedy accuracy with its 95% Wilson interval over the prompts
(`hfjax.run.intervals`; in the JSON as `<source>/greedy_ci95`) and, with `--samples=k` (k > 1,
at `--temperature`), the mean accuracy of the k samples and pass@k (a prompt counts when any of
its k samples scores 1; with its interval). Sampling seeds are fixed per prompt, so two
evaluations of one model agree. The last
line is JSON. With `--responses=FILE.jsonl` every response is written out, one JSON line each
(prompt index, sample, data_source, ground truth, response text, its token count, `finished`:
whether it ended before the length cap, `score`, and `mode`: greedy or sampled), to read what
the model answers and how many replies are well formed.

`--tools=calculator` (or the config's `rollout.multi_turn`) evaluates multi-turn trajectories
(docs/agents.md): the policy's turns, the tools' results between them; each JSONL line then
also holds the trajectory turn by turn (`turns`: the assistant's text, the calls and results
of each tool turn), why it stopped, and its turn, call and error counts.
"""

import json
import os
import tempfile
import time

from absl import flags

from hfjax.config.run_dir import is_run
from hfjax.parallel import distributed
from hfjax.run import intervals
from hfjax.run.export import export_hf
from hfjax.run.validation import evaluate_policy
from launch import cli

DEFAULT_CONFIG, _CONFIG = cli.define_run_flags("ppo_arith.py")
_MODEL = flags.DEFINE_string(
    "model", None, "HF directory, .gguf file, or a training run (out_dir, checkpoint root or "
    "step directory); default: the config's model.path", )
_STEP = flags.DEFINE_integer("step", None, "a run's checkpoint step (default: the newest)")
_DATA = flags.DEFINE_string("data", None, "RL parquet files, comma-separated (default: the "
                            "config's data.val_files, or the embedded task's held-out prompts)")
_SAMPLES = flags.DEFINE_integer("samples", 1, "samples per prompt for pass@k (1: greedy only)")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "temperature of the samples")
_LIMIT = flags.DEFINE_integer("limit", 0, "evaluate the first N prompts only (0: all)")
_RESPONSES = flags.DEFINE_string("responses", None, "write every response to this JSONL file")
_TOOLS = flags.DEFINE_string("tools", None, "multi-turn rollouts with these tools (names or "
                             "pkg.mod:Class, comma-separated; empty: multi-turn without tools); "
                             "default: the config's rollout.multi_turn")


def main(argv):
    del argv
    cfg = _CONFIG.value
    model = _MODEL.value
    run = bool(model) and is_run(model)
    if model and not run:
        cfg.model.path, cfg.model.tokenizer = model, ""
    if _TOOLS.value is not None:
        cfg.rollout.multi_turn.enable, cfg.rollout.multi_turn.tools = True, _TOOLS.value
    if _DATA.value:
        cfg.data.task, cfg.data.val_files = "parquet", _DATA.value
    if cfg.data.task == "parquet":
        # Evaluation reads no training data: the config's training files need not exist here.
        cfg.data.train_files = cfg.data.val_files
    if _RESPONSES.value:
        folder = os.path.dirname(os.path.abspath(_RESPONSES.value))
        if not os.path.isdir(folder):
            raise cli.UserError(f"--responses={_RESPONSES.value}: folder {folder} does not "
                                "exist; create it or pick another path")
    topo = cli.start_run("evaluate", cfg)
    if run and topo.num_processes > 1:
        raise cli.UserError(f"--model={model} is a training run; across processes, export it "
                            "first (launch.export) and pass the HF directory")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hfjax-evaluate-") as tmp:
        if run:
            # The run's actor as an HF directory with the run's tokenizer: one loading path.
            cfg.model.path = export_hf(model, os.path.join(tmp, "hf"), _STEP.value)
            cfg.model.tokenizer = ""
        from hfjax.config.model_source import task_tokenizer
        from hfjax.data.dataset import task_dataset

        tok = task_tokenizer(cfg)
        rows = task_dataset(cfg, tok, "test").rows
        rows = rows[:_LIMIT.value] if _LIMIT.value else rows
        records = {} if _RESPONSES.value else None
        metrics = evaluate_policy(cfg, tok, rows, _SAMPLES.value, _TEMPERATURE.value, records)
    k = _SAMPLES.value
    result = {"model": _MODEL.value or cfg.model.path or "(from scratch)", "prompts": len(rows)}
    # val-core/<source>/acc/mean@n and val-aux/<source>/acc/best@n (a source may hold "/"),
    # reported as greedy (mean@1), mean@k and pass@k, in that order per source.
    labels = {f"mean@{k}": f"mean@{k}", f"best@{k}": f"pass@{k}", "mean@1": "greedy"}
    order = ("greedy", f"mean@{k}", f"pass@{k}")
    found = []
    for name, value in metrics.items():
        head, what, stat = name.rsplit("/", 2)
        if what == "acc" and stat in labels:
            found.append((head.split("/", 1)[1], labels[stat], value))
    counts = {}  # prompts per source: the n of each source's interval
    for r in rows:
        counts[r["data_source"]] = counts.get(r["data_source"], 0) + 1
    for source, label, value in sorted(found, key=lambda f: (f[0], order.index(f[1]))):
        result[f"{source}/{label}"] = round(value, 4)
        n = counts.get(source, len(rows))
        interval = ""
        if label != f"mean@{k}" or k == 1:
            # Greedy and pass@k score each prompt once (0 or 1): a Wilson interval over the
            # prompts. mean@k averages k correlated samples per prompt, so it gets none.
            lo, hi = intervals.accuracy_interval(value, n)
            result[f"{source}/{label}_ci95"] = [round(lo, 4), round(hi, 4)]
            interval = f" (95% interval {intervals.fmt(lo, hi)})"
        if distributed.is_main_process():
            print(f"{source}: {label} accuracy {value:.4f}{interval} on {n} prompts", flush=True)
    if records is not None and distributed.is_main_process():
        # Written whole to a temporary file, then renamed: a partial file never replaces one.
        tmp_path = _RESPONSES.value + ".tmp"
        with open(tmp_path, "w") as f:
            for mode, recs in records.items():
                for rec in recs:
                    f.write(json.dumps({"mode": mode, **rec}) + "\n")
        os.replace(tmp_path, _RESPONSES.value)
        result["responses"] = _RESPONSES.value
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    if distributed.is_main_process():
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    cli.run(main, "evaluate", config_default=DEFAULT_CONFIG)

"""Writes a task's train/test prompt sets as parquet in verl's schema.

    python -m launch.prepare_data --task=gsm_symbolic --n_train=2000 --n_test=200 --out=data/gsm
    python -m launch.prepare_data --task=countdown --task_config='{"min_numbers": 3}' ...

Tasks: gsm_symbolic, basic_arithmetic, countdown, chain_sum (reasoning-gym) and arith (the
embedded arithmetic task), arith_tool (3-4 digit products for the calculator tool, with verl's
multi-turn fields: docs/agents.md), in verl's prompt schema (docs/data.md); `--tools=calculator`
starts every prompt with a system message describing the tools (docs/agents.md), and
`--sft_demos` adds tool-use demonstrations of the same prompts for an SFT warm start
(sft_train.parquet, sft_test.parquet; docs/algorithms.md); and arith_prefs /
arith_cost_prefs, preference pairs for reward / cost models, and arith_judge, SFT rows that
teach a generative judge the exact-answer rule's verdict (docs/algorithms.md):

    python -m launch.prepare_data --task=arith_prefs --n_train=1000 --n_test=200 \
        --task_config='{"max_b": 9, "pairs_per_prompt": 4}' --out=data/arith_prefs
"""

import collections
import json

from absl import flags

from hfjax.data import prepare
from launch import cli

_TASK = flags.DEFINE_enum("task", None, list(prepare.TASKS), "task to generate", required=True)
_N_TRAIN = flags.DEFINE_integer("n_train", 1000, "training prompts")
_N_TEST = flags.DEFINE_integer("n_test", 100, "held-out prompts: problems from the held-out "
                               "third of the task's space, never in a train split")
_OUT = flags.DEFINE_string("out", None, "output directory", required=True)
_SEED = flags.DEFINE_integer("seed", 0, "generator seed; the same seed writes the same files")
_CONFIG = flags.DEFINE_string(
    "task_config", "{}", "JSON object of generator options, e.g. reasoning-gym config fields"
)
_TOOLS = flags.DEFINE_string(
    "tools", "", "tools to tell the model about (names or pkg.mod:Class, comma-separated): each "
    "prompt starts with a system message describing them, and rows get extra_info.tools_kwargs"
)
_SFT_DEMOS = flags.DEFINE_bool(
    "sft_demos", False, "also write sft_train.parquet and sft_test.parquet: tool-use "
    "demonstrations of the same prompts (call the calculator, read its result, answer), "
    "multi-turn SFT parquet for launch.sft; needs --tools=calculator"
)
_ALLOW_OVERLAP = flags.DEFINE_bool(
    "allow_overlap", False, "write a test split that shares problems with the train split (or "
    "with the train.parquet already in --out) instead of refusing it; logged as a warning")


def main(argv):
    del argv
    config = json.loads(_CONFIG.value)
    paths = prepare.prepare(_TASK.value, _N_TRAIN.value, _N_TEST.value, _OUT.value,
                            seed=_SEED.value, config=config, tools=_TOOLS.value,
                            sft_demos=_SFT_DEMOS.value, allow_overlap=_ALLOW_OVERLAP.value)
    import pyarrow.parquet as pq

    for path in paths.values():
        table = pq.read_table(path)
        column = table.column("data_source") if "data_source" in table.column_names else None
        sources = collections.Counter(column.to_pylist() if column is not None else [])
        print(f"wrote {path}: {table.num_rows} rows, data_source {dict(sources)}")
    first = pq.read_table(next(iter(paths.values()))).slice(0, 1).to_pylist()[0]
    if "sft_train" in paths or "sft_test" in paths:
        demo = pq.read_table(paths.get("sft_train") or paths["sft_test"]).slice(0, 1)
        print("first demonstration's turns after the prompt:")
        print(json.dumps(demo.to_pylist()[0]["messages"][len(first["prompt"]):],
                         ensure_ascii=False))
    extra = first.get("extra_info") or {}
    if isinstance(extra.get("entry"), str) and len(extra["entry"]) > 120:
        extra["entry"] = extra["entry"][:120] + "..."
    print("first row:")
    print(json.dumps(first, indent=2, ensure_ascii=False))


if __name__ == "__main__":
    cli.run(main, "prepare_data")

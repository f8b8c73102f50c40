"""Writes task sets as train/test parquet files in verl's schema (see docs/data.md).

Tasks: reasoning-gym's gsm_symbolic, basic_arithmetic, countdown and chain_sum, the
embedded arithmetic task `arith`, the tool-use task `arith_tool`; and preference pairs on the
arithmetic task's prompts, for reward-model training (`arith_prefs`: right answers preferred
to wrong or unformatted ones) and cost-model training (`arith_cost_prefs`: answers without the
digit 7 preferred to answers with one), in the schema of `hfjax.data.preferences`; and a
generative judge's SFT rows (`arith_judge`: the same correctness pairs as verdicts, "1" for the
right answer and "0" for the other, the prompt the judge template filled in:
`hfjax.data.arith.judge_rows`; task_config "template" sets another template).

- A reasoning-gym row has data_source `reasoning_gym/<task>`. Its prompt is the generated
  question followed by verl's GSM8K instruction (`GSM_SUFFIX`), because the reward reads the
  answer after `####`. Its ground truth is the entry's answer, and `extra_info["entry"]` holds
  the whole entry as JSON (values JSON cannot hold, such as fractions, written as text) for
  reasoning-gym's scorer.
- An `arith` row is `hfjax.data.arith`'s row: data_source `hfjax/arith`, prompt "a+b=".
- An `arith_tool` row (data_source `hfjax/arith_tool`) asks for a product of two 3- or
  4-digit numbers, "a*b=", which a small model cannot work out in its head but the
  `calculator` tool can. It carries verl's multi-turn fields: `agent_name` "tool_agent",
  `extra_info.tools_kwargs` (per tool, verl's `create_kwargs`) and
  `extra_info.interaction_kwargs` (`name`, `query`, `ground_truth`).

`tools` (e.g. "calculator") tells the model about tools through the data, for chat templates
that ignore a `tools` list (SmolLM2's): every prompt starts with a system message describing
them (`hfjax.tools.prompt.system_message`: name, description, JSON schema of the arguments, the
`<tool_call>` format), and every row gets `agent_name` "tool_agent" and verl's
`extra_info.tools_kwargs` for them.

`sft_demos` also writes tool-use demonstrations of the same prompts (call the calculator, read
its result, answer) as multi-turn SFT parquet, for a warm start before RL with the tool
(`hfjax.data.tool_demos`).

Train and test come from one seeded stream of problems, deduplicated by the problem's identity
(`hfjax.data.holdout.problem_key`: an arithmetic problem's operands and operator, a
reasoning-gym question's normalised text) and sent to the side of the held-out partition that
identity falls in: the same third of every task's problems is test-only whatever the seed or
sizes, so no test problem occurs in any training file, SFT demonstration or preference pair
written for the task, and the same seed always writes the same files. Writing a split next to
an existing file of the other split checks the two for shared problems, and refuses overlap
unless `allow_overlap` (logged).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from hfjax.data import arith, holdout, preferences, tool_arith, tool_demos
from hfjax.tools import prompt as tool_prompt
from hfjax.tools import resolve_tools

# Writing data only reads the tools' names, descriptions and schemas, and never calls them: the
# python tool is built without probing its jail, so data for it can be prepared on a machine
# that could not run it (the run that calls it still refuses there).
DESCRIBE_ONLY = {"python": {"isolation": "none"}}

GSM_SUFFIX = 'Let\'s think step by step and output the final answer after "####".'
RG_PREFIX = "reasoning_gym/"
RG_TASKS = {
    "gsm_symbolic": "math",
    "basic_arithmetic": "arithmetic",
    "countdown": "arithmetic",
    "chain_sum": "arithmetic",
}
# Preference tasks: their rows are made from the arith task's rows (same seeded stream and
# split), turned into pairs by `arith.preference_rows` of the given kind.
PREFERENCE_TASKS = {"arith_prefs": "correctness", "arith_cost_prefs": "forbidden_digit"}
# A judge's SFT rows (`arith.judge_rows`), from the correctness pairs of the same prompts.
JUDGE_TASK = "arith_judge"
TASKS = (*RG_TASKS, "arith", "arith_tool", *PREFERENCE_TASKS, JUDGE_TASK)

_MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
_REWARD_MODEL = pa.struct([("style", pa.string()), ("ground_truth", pa.string())])


_IMAGES = pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))


def write_rows(rows: list[dict], path: str | os.PathLike) -> None:
    """Write verl-schema rows to one parquet file (extra_info's struct type is inferred)."""
    if not rows:
        raise ValueError(f"no rows to write to {path}")
    columns = {
        "data_source": pa.array([r["data_source"] for r in rows], pa.string()),
        "prompt": pa.array([r["prompt"] for r in rows], _MESSAGES),
        "ability": pa.array([r.get("ability") for r in rows], pa.string()),
        "reward_model": pa.array([r["reward_model"] for r in rows], _REWARD_MODEL),
        "extra_info": pa.array([r.get("extra_info") for r in rows]),
    }
    if any("agent_name" in r for r in rows):
        # verl's multi-turn column: which agent loop runs the row.
        columns["agent_name"] = pa.array([r.get("agent_name") for r in rows], pa.string())
    if any(r.get("images") for r in rows):
        # verl's multimodal column (HF datasets' Image feature): {bytes, path} per image.
        columns["images"] = pa.array([r.get("images") or [] for r in rows], _IMAGES)
    pq.write_table(pa.table(columns), os.fspath(path))


def write_sft_rows(rows: list[dict], path: str | os.PathLike) -> None:
    """SFT rows {data_source, prompt, response} (strings) to one SFT parquet file."""
    pq.write_table(pa.table({k: pa.array([r[k] for r in rows], pa.string())
                             for k in ("data_source", "prompt", "response")}), os.fspath(path))


def _rg_stream(task: str, seed: int, config: dict, size: int) -> Iterator[dict]:
    import reasoning_gym

    start = 0
    while True:
        # Some generators precompute per-entry choices for the whole size, so the dataset is
        # made as large as needed and regrown (same seed) only if duplicates run it short.
        try:
            ds = reasoning_gym.create_dataset(task, seed=seed, size=size, **config)
        except (TypeError, ValueError, AssertionError) as err:  # reasoning-gym asserts, too
            raise ValueError(f"task config {config} for {task!r}: {type(err).__name__}: {err}; "
                             "give options the generator takes") from None
        for index in range(start, size):
            entry = ds[index]
            question = entry["question"].rstrip()
            yield {
                "data_source": RG_PREFIX + task,
                "prompt": [{"role": "user", "content": f"{question} {GSM_SUFFIX}"}],
                "ability": RG_TASKS[task],
                "reward_model": {"style": "rule", "ground_truth": str(entry["answer"])},
                "extra_info": {
                    "question": entry["question"],
                    "entry": json.dumps(entry, default=str, sort_keys=True),
                },
            }
        start, size = size, size * 2


def _arith_stream(seed: int, config: dict) -> Iterator[dict]:
    size, start = 1024, 0
    while True:
        # problems() draws from one generator, so a longer list extends a shorter one.
        try:
            rows = arith.problems(size, seed=seed, **config)
        except TypeError as err:
            raise ValueError(f"task config {config} for 'arith': {err}; it takes max_b") from None
        yield from rows[start:]
        start, size = size, size * 2


def _arith_tool_stream(seed: int, config: dict) -> Iterator[dict]:
    config = dict(config)
    digits = config.pop("digits", [3, 4])
    if config:
        raise ValueError(f"task config {config} for 'arith_tool': it takes only digits, "
                         "e.g. {\"digits\": [3, 4]}")
    if (not isinstance(digits, (list, tuple)) or len(digits) != 2
            or not all(isinstance(d, int) and not isinstance(d, bool) for d in digits)
            or not 1 <= digits[0] <= digits[1] <= 9):
        raise ValueError(f"task config digits={digits!r} for 'arith_tool': give [fewest, most] "
                         "digits per operand, 1 <= fewest <= most <= 9")
    rng = np.random.default_rng(seed)
    while True:
        yield tool_arith.row(*tool_arith.draw(rng, *digits))


def with_tools(row: dict, system: str, tools_kwargs: dict) -> dict:
    """`row` with `system` first in its prompt (before an existing system message's text),
    agent_name "tool_agent" and `tools_kwargs` as its extra_info.tools_kwargs."""
    messages = [dict(m) for m in row["prompt"]]
    if messages and messages[0]["role"] == "system":
        messages[0]["content"] = f"{system}\n\n{messages[0]['content']}"
    else:
        messages.insert(0, {"role": "system", "content": system})
    extra = dict(row.get("extra_info") or {}, tools_kwargs=tools_kwargs)
    return dict(row, prompt=messages, agent_name=tool_arith.AGENT_NAME, extra_info=extra)


def make_splits(
    task: str, n_train: int, n_test: int, seed: int = 0, config: dict | None = None,
    tools: str = "",
) -> tuple[list[dict], list[dict]]:
    """(train rows, test rows): distinct prompts drawn from one seeded stream; with `tools`
    (a tool spec, e.g. "calculator"), each prompt starts with the system message that describes
    them (`with_tools`)."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    if tools.strip():
        if task in PREFERENCE_TASKS:
            raise ValueError(f"task {task!r} writes preference pairs, which take no tools; "
                             "drop --tools")
        resolved = resolve_tools(tools, DESCRIBE_ONLY)
        system = tool_prompt.system_message(resolved)
        train, test = make_splits(task, n_train, n_test, seed, config)
        return tuple(
            [with_tools(r, system, tool_prompt.tools_kwargs(resolved, r["prompt"][-1]["content"]))
             for r in rows]
            for rows in (train, test))
    if n_train < 0 or n_test < 0 or n_train + n_test == 0:
        raise ValueError(f"need n_train, n_test >= 0 and not both 0, got {n_train}, {n_test}")
    config = dict(config or {})
    if task in PREFERENCE_TASKS:
        return _preference_splits(task, n_train, n_test, seed, config)
    if task == JUDGE_TASK:
        template = config.pop("template", arith.JUDGE_TEMPLATE)
        return tuple(arith.judge_rows(rows, template)
                     for rows in _preference_splits("arith_prefs", n_train, n_test, seed, config))
    if task == "arith":
        stream = _arith_stream(seed, config)
    elif task == "arith_tool":
        stream = _arith_tool_stream(seed, config)
    else:
        # The test side keeps a third of the problems, so a test split of n takes ~3n draws.
        stream = _rg_stream(task, seed, config, size=3 * n_test + 3 * n_train // 2 + 16)
    splits: dict[str, list[dict]] = {"train": [], "test": []}
    wanted = {"train": n_train, "test": n_test}
    seen: set[str] = set()
    drawn, limit = 0, 20 * (n_train + n_test) + 1000
    for row in stream:
        drawn += 1
        if drawn > limit:
            short = [f"{s} {len(splits[s])} of {wanted[s]}" for s in splits
                     if len(splits[s]) < wanted[s]]
            raise ValueError(
                f"task {task}: only {len(seen)} distinct problems in {limit} draws "
                f"({', '.join(short)} filled: a third of the problems are held out for "
                "test); ask for fewer or widen the task config")
        key = holdout.problem_key(row)
        if key in seen:
            continue
        seen.add(key)
        # Each problem's side is fixed by its identity (hfjax.data.holdout), whatever the
        # seed or sizes, so no test problem is in any training file this task writes.
        split = "test" if holdout.is_heldout(key) else "train"
        if len(splits[split]) == wanted[split]:
            continue
        row["extra_info"] = dict(row["extra_info"], split=split, index=len(splits[split]))
        splits[split].append(row)
        if all(len(splits[s]) == wanted[s] for s in splits):
            break
    return splits["train"], splits["test"]


def _preference_splits(task, n_train, n_test, seed, config):
    # Pairs per prompt is this task's own option; the rest goes to the arith generator.
    per_prompt = int(config.pop("pairs_per_prompt", 1))
    train, test = make_splits("arith", n_train, n_test, seed, config)
    kind = PREFERENCE_TASKS[task]
    return (arith.preference_rows(train, seed + 1, kind, per_prompt),
            arith.preference_rows(test, seed + 2, kind, per_prompt))


def check_files_disjoint(train: list[dict], test: list[dict], out_dir: str | os.PathLike,
                         allow: bool = False) -> None:
    """Refuses (one line; logged instead with `allow`) test rows sharing a problem with the
    training rows; a split asked for with 0 rows is taken from its file in `out_dir`, when
    there is one, so a test set written beside an earlier training set is checked against it."""
    def rows_of(rows, split):
        path = os.path.join(os.fspath(out_dir), f"{split}.parquet")
        if rows or not os.path.isfile(path):
            return rows, f"the {split} split"
        return pq.read_table(path, columns=["prompt"]).to_pylist(), path

    (train, train_name), (test, test_name) = rows_of(train, "train"), rows_of(test, "test")
    holdout.check_disjoint(map(holdout.problem_key, train), map(holdout.problem_key, test),
                           f"{test_name} against {train_name}", "--allow_overlap", allow)


def prepare(
    task: str, n_train: int, n_test: int, out_dir: str | os.PathLike, seed: int = 0,
    config: dict | None = None, tools: str = "", sft_demos: bool = False,
    allow_overlap: bool = False,
) -> dict[str, str]:
    """Write `train.parquet` and `test.parquet` for `task` into `out_dir` (with `tools`: the
    system message and tools_kwargs of `make_splits`); with `sft_demos`, also
    `sft_train.parquet` and `sft_test.parquet`, tool-use demonstrations of the same prompts
    (`hfjax.data.tool_demos`; needs the calculator in `tools`). Returns the paths of the files
    written (a split with 0 rows is not written). A test split that shares a problem with the
    train split, or with the other split's file already in `out_dir` when one split is empty,
    is refused (`check_files_disjoint`)."""
    if sft_demos and (task in PREFERENCE_TASKS or task == JUDGE_TASK):
        raise ValueError(f"task {task!r} writes pairs or a judge's SFT rows; --sft_demos needs "
                         "a task with arithmetic expressions")
    named = resolve_tools(tools, DESCRIBE_ONLY) if tools.strip() else {}
    if sft_demos and "calculator" not in named:
        raise ValueError("--sft_demos writes calls to the calculator; add --tools=calculator")
    train, test = make_splits(task, n_train, n_test, seed, config, tools)
    check_files_disjoint(train, test, out_dir, allow_overlap)
    os.makedirs(out_dir, exist_ok=True)
    paths = {}
    write = (preferences.write_rows if task in PREFERENCE_TASKS
             else write_sft_rows if task == JUDGE_TASK else write_rows)
    for split, rows in (("train", train), ("test", test)):
        if rows:
            paths[split] = os.path.join(os.fspath(out_dir), f"{split}.parquet")
            write(rows, paths[split])
        if rows and sft_demos:
            demos, _ = tool_demos.demonstrations(rows, tools)
            paths[f"sft_{split}"] = os.path.join(os.fspath(out_dir), f"sft_{split}.parquet")
            tool_demos.write_demonstrations(demos, paths[f"sft_{split}"])
    return paths

"""The flags of the entry points other than train: a row per flag (`FLAG_KEYS[entry]`) and
the rules between them (`FLAG_RULES[entry]`)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from hfjax.config.validators import (
    cache_dir,
    existing,
    json_object,
    mesh,
    model_or_run,
    model_path,
    output_dir,
    parquet_files,
    prompts,
    target_name,
    tool_spec,
)
from hfjax.config.values import Bool, Check, Float, Int

_CACHE = Check(cache_dir)

FLAG_KEYS: dict[str, dict[str, Callable[[Any], str | None]]] = {
    "train": {
        "cpu_devices": Int(0, note="0: leave XLA_FLAGS alone"),
        "target": Check(target_name),
        "num_devices": Int(1),
        "device_memory_gib": Check(lambda v: None if v is None or v > 0 else "needs a "
                                   "positive number of GiB"),
    },
    "sft": {"cpu_devices": Int(0, note="0: leave XLA_FLAGS alone")},
    "evaluate": {
        "cpu_devices": Int(0, note="0: leave XLA_FLAGS alone"),
        "model": Check(model_or_run),
        "step": Check(lambda v: None if v is None else Int(0)(v)),
        "data": Check(lambda v: None if v is None else parquet_files(v)),
        "samples": Int(1),
        "temperature": Float(0.0, lo_open=True),
        "limit": Int(0, note="0: every prompt"),
        "tools": Check(lambda v: None if v is None else tool_spec(v)),
    },
    "train_rm": {"cpu_devices": Int(0, note="0: leave XLA_FLAGS alone")},
    "generate": {
        "model": Check(model_path(optional=True)),
        "prompt": Check(prompts),
        "max_new_tokens": Int(1),
        "temperature": Float(0.0, note="0: greedy"),
        "top_k": Int(0, note="0: off"),
        "top_p": Float(0.0, 1.0, lo_open=True, note="1: off"),
        "min_p": Float(0.0, 1.0, hi_open=True, note="0: off"),
        "n": Int(1),
        "seed": Int(0),
        "mesh": Check(lambda v: None if v is None else mesh(optional=False)(v)),
        "tools": Check(lambda v: None if v is None else tool_spec(v)),
        "max_turns": Int(1),
        "compilation_cache_dir": _CACHE,
    },
    "convert": {
        "src": Check(model_path(optional=False)),
        "dst": Check(output_dir),
        "compilation_cache_dir": _CACHE,
    },
    "export": {
        "ckpt": Check(existing("directory")),
        "out": Check(output_dir),
        "step": Check(lambda v: None if v is None else Int(0)(v)),
        "tokenizer": Check(existing("tokenizer directory or .gguf file", optional=True)),
        "compilation_cache_dir": _CACHE,
    },
    "prepare_data": {
        "n_train": Int(0),
        "n_test": Int(0),
        "out": Check(output_dir),
        "seed": Int(0),
        "task_config": Check(json_object),
        "tools": Check(tool_spec),
        "sft_demos": Bool(),
    },
}


def _inside(path: str, root: str) -> bool:
    path, root = os.path.realpath(path), os.path.realpath(root)
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _holds(path: str, other: str) -> bool:
    """Whether replacing directory `path` would delete or replace `other`."""
    return _inside(other, path)


def _convert_target(v) -> str | None:
    if _holds(v["dst"], v["src"]):
        return (f"--dst={v['dst']} would replace the source model {v['src']}; write to "
                "another directory")
    return _replaceable(v["dst"], "--dst")


def _export_target(v) -> str | None:
    ckpt = os.path.realpath(v["ckpt"])
    # The run directory: the ckpt path itself, or the out_dir above a checkpoint root or step.
    run = ckpt
    while os.path.basename(run).isdigit() or os.path.basename(run) == "checkpoints":
        run = os.path.dirname(run)
    if (_holds(v["out"], run) or _holds(v["out"], ckpt)
            or _inside(v["out"], os.path.join(run, "checkpoints"))):
        return (f"--out={v['out']} would replace the run directory {run}; write the HF model "
                f"elsewhere, e.g. --out={os.path.join(run, 'hf')}")
    return _replaceable(v["out"], "--out")


def _replaceable(out: str, flag: str) -> str | None:
    # save_hf replaces its output directory whole; only an earlier export may be replaced.
    if os.path.isdir(out) and os.listdir(out) and not os.path.isfile(
            os.path.join(out, "config.json")):
        return (f"{flag}={out} is a non-empty directory that holds no HF model; it would be "
                "replaced: choose a new or empty directory")
    return None


def _some_rows(v) -> str | None:
    if v["n_train"] + v["n_test"] == 0:
        return "--n_train=0 and --n_test=0 ask for no rows; ask for at least one"
    return None


def _demos_need_calculator(v) -> str | None:
    if v.get("sft_demos") and "calculator" not in [t.strip() for t in v["tools"].split(",")]:
        return "--sft_demos writes calls to the calculator; add --tools=calculator"
    return None


def _step_needs_run(v) -> str | None:
    from hfjax.config.run_dir import is_run

    step, model = v.get("step"), v.get("model")
    if step is not None and not (model and is_run(model)):
        return f"--step={step} picks a checkpoint, but --model is not a training run"
    return None


FLAG_RULES: dict[str, tuple[Callable[[Mapping[str, Any]], str | None], ...]] = {
    "convert": (_convert_target,),
    "export": (_export_target,),
    "evaluate": (_step_needs_run,),
    "prepare_data": (_some_rows, _demos_need_calculator),
}

"""The flags of the entry points: a row per flag (`FLAG_KEYS[entry]`, plus `COMMON_FLAG_KEYS`
for the flags that launch/cli.py and the process flags give several entry points) and the rules
between them (`FLAG_RULES[entry]`). Every flag that a launch/ module defines has a row
(tests/config/test_flag_rows.py walks them): a type, a range or a choice. `launch.cli.run`
checks them all before an entry point's main runs (`flag_checks`)."""

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
    plan_target_name,
    prompts,
    target_name,
    tool_spec,
)
from hfjax.settings.values import Bool, Check, Choice, Float, Int, Text

_CACHE = Check(cache_dir)


def _prepare_tasks() -> tuple[str, ...]:
    from hfjax.data import prepare

    return tuple(prepare.TASKS)


def _optional(check: Callable[[Any], str | None]) -> Check:
    """`check`, or None (the flag's unset default)."""
    return Check(lambda v: None if v is None else check(v))


def _host_port(v) -> str | None:
    host, _, port = v.rpartition(":") if isinstance(v, str) else ("", "", "")
    if host and port.isdigit() and 0 < int(port) < 65536:
        return None
    return "needs host:port, e.g. 10.0.0.1:1234"


def _config_file(v) -> str | None:
    # The file's keys and --config.<key> overrides are checked by the key table
    # (hfjax.config.keys, `check_config`) where the entry point starts.
    return None if hasattr(v, "items") else "needs a config file (configs/*.py)"


_DTYPE = Choice(("float32", "bfloat16"))
_OUT_FILE = _optional(Text(nonempty=True, note="a file path"))

# The flags that launch/cli.py defines (`--verbose`, `--config`, `--compilation_cache_dir`) and
# the process flags (`hfjax.parallel.distributed.define_flags`) of every entry point that can
# run on several hosts. An entry's own row for the same name takes precedence.
COMMON_FLAG_KEYS: dict[str, Callable[[Any], str | None]] = {
    "verbose": Bool(),
    "config": Check(_config_file),
    "compilation_cache_dir": _CACHE,
    "coordinator_address": _optional(_host_port),
    "num_processes": _optional(Int(1)),
    "process_id": _optional(Int(0)),
    "cpu_devices": Int(0, note="0: leave XLA_FLAGS alone"),
    "coordinator_timeout_s": Int(1),
    "heartbeat_timeout_s": Int(1),
    "shutdown_timeout_s": Int(1),  # hfjax.parallel.distributed refuses 0 too
}

FLAG_KEYS: dict[str, dict[str, Callable[[Any], str | None]]] = {
    "train": {
        "cpu_devices": Int(0, note="0: leave XLA_FLAGS alone"),
        "target": Check(target_name),
        "num_devices": Int(1),
        "device_memory_gib": Check(lambda v: None if v is None or v > 0 else "needs a "
                                   "positive number of GiB"),
        "dry_run": Bool(),
        "memory_check": Bool(),
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
        "responses": _OUT_FILE,
    },
    "train_rm": {"cpu_devices": Int(0, note="0: leave XLA_FLAGS alone")},
    "train_dpo": {"cpu_devices": Int(0, note="0: leave XLA_FLAGS alone")},
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
        "chat": Bool(),
        "dtype": _DTYPE,
        "max_layers": Int(0, note="0: all"),
        "responses": _OUT_FILE,
    },
    "convert": {
        "src": Check(model_path(optional=False)),
        "dst": Check(output_dir),
        "compilation_cache_dir": _CACHE,
        "dtype": _DTYPE,
    },
    "export": {
        "ckpt": Check(existing("directory")),
        "out": Check(output_dir),
        "step": Check(lambda v: None if v is None else Int(0)(v)),
        "tokenizer": Check(existing("tokenizer directory or .gguf file", optional=True)),
        "compilation_cache_dir": _CACHE,
        "format": Choice(("merged", "hf", "peft"), note="hf is merged's other name; peft: a "
                         "LoRA run's adapters"),
    },
    "prepare_data": {
        "n_train": Int(0),
        "n_test": Int(0),
        "out": Check(output_dir),
        "seed": Int(0),
        "task_config": Check(json_object),
        "tools": Check(tool_spec),
        "sft_demos": Bool(),
        "allow_overlap": Bool(),
        "task": Choice(_prepare_tasks),
    },
    "plan": {
        "target": Check(plan_target_name),
        "num_devices": Int(1),
        "emit_config": Text(note="a flagfile path; empty: none"),
        "reward_model": Text(note="preset:NAME, an HF directory or a .gguf; empty: the config's"),
        "efficiency": Text(note="e.g. train=0.4,hbm=0.6"),
        "calibration": Check(existing("file", optional=True)),
        "node_size": _optional(Int(1)),
        "scale_out_gbps": _optional(Float(0.0, lo_open=True)),
        "memory_fraction": Float(0.0, 1.0, lo_open=True),
        "alternatives": Int(0),
        "score_micro": _optional(Int(0, note="0: the whole batch")),
        "prices": Choice(("closed_form", "compiled")),
        "compile_budget_s": Float(0.0),
        "gen_rows": _optional(Int(-1, note="0: all; -1: the planner picks")),
    },
    "local_cluster": {
        "num_processes": Int(1),
        "devices_per_process": Int(0, note="0: leave XLA's default"),
        "module": Text(nonempty=True),
        "script": Check(existing("file", optional=True)),
        "port": Int(0, 65535, note="0: a free one"),
        "stop_grace_s": Float(0.0),
    },
}


def flag_checks(entry: str) -> dict[str, Callable[[Any], str | None]]:
    """Every row that applies to entry point `entry`'s flags: the common ones, then its own."""
    return {**COMMON_FLAG_KEYS, **FLAG_KEYS.get(entry, {})}


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
    # save_hf and save_peft replace their output directory whole; only an earlier export (an
    # HF model or a PEFT adapter, either format) may be replaced.
    if os.path.isdir(out) and os.listdir(out) and not any(
            os.path.isfile(os.path.join(out, name))
            for name in ("config.json", "adapter_config.json")):
        return (f"{flag}={out} is a non-empty directory that holds no HF model or PEFT "
                "adapter; it would be replaced: choose a new or empty directory")
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

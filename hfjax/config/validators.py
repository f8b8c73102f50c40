"""Checks of single values that need a registry or the file system (algorithm and estimator
names, model paths, meshes, data files, output directories)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from typing import Any

from hfjax.settings import checks
from hfjax.settings.checks import (  # noqa: F401  (the config's checks, one import)
    kl_names,
    level_or_off,
    mesh,
    registry,
    tool_spec,
)


def algorithm(v) -> str | None:
    if not isinstance(v, str) or not v:
        return "needs a registered algorithm's name or package.module:step"
    from hfjax.algorithms.registry import get_algorithm

    try:  # a user algorithm's module is imported here, registering what it brings
        get_algorithm(v)
    except ValueError as err:
        return str(err)
    return None


def kl_controllers() -> tuple[str, ...]:
    from hfjax.numerics.losses import KL_CONTROLLERS

    return tuple(sorted(KL_CONTROLLERS))


def corruptions() -> tuple[str, ...]:
    from hfjax.data.arith import CORRUPTIONS

    return CORRUPTIONS


def layout_rules() -> tuple[str, ...]:
    from hfjax.parallel.sharding import RULE_SETS

    return ("auto", *RULE_SETS)


def remat_policies() -> tuple[str, ...]:
    from hfjax.models.config import REMAT_POLICIES

    return (*REMAT_POLICIES, "auto")


def attention_impls() -> tuple[str, ...]:
    from hfjax.models.config import ATTENTION_IMPLS

    return ATTENTION_IMPLS


def placement(v) -> str | None:
    from hfjax.controller.placement import MODES, parse_mapping

    if isinstance(v, str) and "=" in v:
        try:
            parse_mapping(v)
        except ValueError as err:
            return str(err)
        return None
    if isinstance(v, str):
        return None if v in MODES else (
            f"needs one of {', '.join(MODES)}, a mapping {{pool: {{size, roles}}}}, or on the "
            "command line 'pool=size:role+role;...', e.g. 'gen=4:actor+ref;"
            "score=4:critic+reward'")
    if hasattr(v, "items"):
        return None  # the pools and roles are checked against the devices (validate_config)
    return f"needs a mode name or a mapping, not a {type(v).__name__}"


def model_path(optional: bool, preset: bool = False) -> Callable[[Any], str | None]:
    """`hfjax.settings.checks.model_path`, accepting "preset:<name>" paths where `preset`."""
    return checks.model_path(optional, _preset_problem if preset else None)


def _preset_problem(path: str) -> str | None:
    from hfjax.models import presets, qwen2_5_vl

    name = presets.preset_name(path)
    if name in qwen2_5_vl.PRESETS:  # a vision-language one
        return None
    try:
        presets.get_preset(name)
    except ValueError as err:
        return f"{err}, {', '.join(sorted(qwen2_5_vl.PRESETS))}"
    return None


def model_or_run(v) -> str | None:
    """A model (`model_path`) or a training run's directory (launch.evaluate's --model)."""
    if isinstance(v, str) and os.path.isdir(v) and not os.path.isfile(
            os.path.join(v, "config.json")):
        from hfjax.config.run_dir import is_run

        if is_run(v):
            return None
        return ("is neither an HF model directory (no config.json) nor a training run (no "
                "checkpoints); pass a model directory, a .gguf file or a run's out_dir")
    return model_path(optional=True, preset=True)(v)


def target_name(v) -> str | None:
    if v is None:
        return None
    from hfjax.parallel import targets

    try:
        targets.get_target(v)
    except ValueError as err:
        return str(err)
    return None


def plan_target_name(v) -> str | None:
    """A target the planner prices: a device model, or "cpu" (this machine's simulated devices
    as measured, hfjax/planner/simulator.measured_cpu)."""
    if isinstance(v, str) and v.strip().lower() == "cpu":
        return None
    return target_name(v)


def existing(kind: str, optional: bool = False) -> Callable[[Any], str | None]:
    def check(v) -> str | None:
        if optional and (v is None or v == ""):
            return None
        if not isinstance(v, str) or not v:
            return f"needs the path of an existing {kind}"
        test = os.path.isdir if kind == "directory" else os.path.exists
        return None if test(v) else f"no such {kind}"

    return check


def output_dir(v) -> str | None:
    if not isinstance(v, str) or not v.strip():
        return "needs a directory path"
    if os.path.exists(v) and not os.path.isdir(v):
        return "is an existing file, not a directory; choose another path"
    return None


def parquet_files(v) -> str | None:
    if not isinstance(v, str):
        return "needs comma-separated parquet paths"
    missing = [p for p in split(v) if not os.path.isfile(p)]
    return f"no such file: {', '.join(missing)}" if missing else None


def custom_reward(v) -> str | None:
    if v == "":
        return None
    if not isinstance(v, str):
        return "needs path/to/file.py:function_name"
    # The spec only: the file is imported in the reward scorer processes, under the reward
    # timeout (hfjax.rewards.pool), never here.
    from hfjax.rewards.custom import check_spec

    try:
        check_spec(v)
    except ValueError as err:
        return str(err)
    return None


def spec(v) -> str | None:
    if v == "":
        return None
    from hfjax.algorithms.registry import import_spec

    try:
        fn = import_spec(v) if isinstance(v, str) else None
    except ValueError as err:
        return str(err)
    return None if callable(fn) else "needs package.module:function or path/to/file.py:function"


def judge_template(v) -> str | None:
    from hfjax.rewards.judge import template_problem

    return template_problem(v)


def verdict_parser(v) -> str | None:
    from hfjax.rewards.judge import parser_problem

    return parser_problem(v)


def source_weights(v) -> str | None:
    from hfjax.workers.reward import parse_source_weights

    try:
        parse_source_weights(v)
    except ValueError as err:
        return str(err)
    return None


def rm_targets() -> tuple[str, ...]:
    from hfjax.data.preferences import TARGETS

    return tuple(TARGETS)


def preference_losses() -> tuple[str, ...]:
    from hfjax.numerics.preference import PREFERENCE_LOSSES

    return PREFERENCE_LOSSES.names()


SINK_NAMES = ("console", "jsonl", "tensorboard", "wandb", "mlflow")


def parse_sink_names(names: str | Iterable[str]) -> list[str]:
    """`"console,jsonl"` or a list -> validated names (see SINK_NAMES)."""
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",")]
    names = [n for n in names if n]
    bad = [n for n in names if n not in SINK_NAMES]
    if bad:
        raise ValueError(f"trainer.logger: unknown sink(s) {bad}; choose from {SINK_NAMES}")
    return names


def sinks(v) -> str | None:
    try:
        names = parse_sink_names(v)
    except ValueError as err:
        return str(err)
    # A tracker whose optional extra is not installed is refused here, before the run starts.
    for name in names:
        if name in TRACKER_EXTRAS and (problem := missing_extra(name)):
            return problem
    return None


# The optional extra (pyproject.toml) that provides each tracker sink, and the module it
# installs (hfjax.run.trackers imports it when the sink starts).
TRACKER_EXTRAS = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}


def missing_extra(name: str) -> str | None:
    """The one-line refusal when tracker `name`'s package is not importable, else None."""
    import importlib.util

    extra, module = TRACKER_EXTRAS[name]
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: sys.modules holds None (import blocked)
        found = False
    if found:
        return None
    return (f"trainer.logger includes {name!r} but the {module} package is not installed: "
            f'pip install -e ".[{extra}]" (or drop {name} from trainer.logger)')


def resume(v) -> str | None:
    v = str(v)
    if v in ("auto", "disable") or os.path.isdir(v):
        return None
    return ("not auto, disable or an existing checkpoint directory (a run's out_dir, "
            "checkpoint root or step dir)")


def cache_dir(v) -> str | None:
    if not isinstance(v, str) or not v:
        return "needs 'auto', 'off' or a directory"
    if v not in ("auto", "off") and os.path.exists(v) and not os.path.isdir(v):
        return "is a file; give a directory, 'auto' or 'off'"
    return None


def json_object(v) -> str | None:
    try:
        parsed = json.loads(v)
    except (TypeError, json.JSONDecodeError) as err:
        return f"is not JSON ({err})"
    return None if isinstance(parsed, dict) else "needs a JSON object, e.g. '{\"size\": 3}'"


def prompts(v) -> str | None:
    if not v or not all(isinstance(p, str) and p.strip() for p in v):
        return "needs at least one non-empty prompt"
    return None


def split(files: str) -> list[str]:
    return [f.strip() for f in files.split(",") if f.strip()]



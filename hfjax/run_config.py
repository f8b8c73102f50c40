"""Every setting of every entry point, checked in one pass before anything is built or written.

A train config's keys each have one row in `TRAIN_KEYS` (what a valid value is); rules that tie
keys together are the functions in `TRAIN_RULES`. The flags of the other entry points have
their rows in `FLAG_KEYS[entry]` and their cross-flag rules in `FLAG_RULES[entry]`.

- `check_config(cfg)`: a train config, every key and rule, with no devices and no files
  written (a config key missing from `TRAIN_KEYS`, e.g. a typo in a derived config, is an
  error too: add its row here when adding a key);
- `check_flags(entry, values)`: one entry point's flags;
- `register_keys(rows)`: rows for the config sections of a user algorithm's own roles (called
  when its module is imported, which the `algorithm` key's check does first);
- `validate_config(cfg)`: `check_config` plus what needs the devices (placement, meshes, batch
  splits over the data-parallel size); it returns the Algorithm and each role's pool.

Each raises `ConfigError` (a ValueError) with one line naming the key, its value, what a valid
value is and how to set it. Heavy modules (JAX, the registries) are imported inside the checks
that need them, so an entry point that never compiles can run its checks without loading JAX.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any


class ConfigError(ValueError):
    """A setting refused before any work starts."""


# -- value checks: each returns None for a valid value, else what a valid value looks like ----


@dataclasses.dataclass(frozen=True)
class Int:
    """An int (not a bool) in [lo, hi]."""

    lo: int | None = None
    hi: int | None = None
    note: str = ""

    def __call__(self, v) -> str | None:
        ok = isinstance(v, int) and not isinstance(v, bool)
        ok = ok and (self.lo is None or v >= self.lo) and (self.hi is None or v <= self.hi)
        return None if ok else _with_note(f"needs an int{_bounds(self.lo, self.hi)}", self.note)


@dataclasses.dataclass(frozen=True)
class Float:
    """A finite number in the interval given by lo/hi, each bound open or closed."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    note: str = ""

    def __call__(self, v) -> str | None:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        if ok and self.lo is not None:
            ok = v > self.lo if self.lo_open else v >= self.lo
        if ok and self.hi is not None:
            ok = v < self.hi if self.hi_open else v <= self.hi
        if ok:
            return None
        if self.lo is not None and self.hi is not None:
            want = (f"a float in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}"
                    f"{')' if self.hi_open else ']'}")
        elif self.lo is not None:
            want = f"a float {'>' if self.lo_open else '>='} {self.lo:g}"
        elif self.hi is not None:
            want = f"a float {'<' if self.hi_open else '<='} {self.hi:g}"
        else:
            want = "a finite float"
        return _with_note(f"needs {want}", self.note)


@dataclasses.dataclass(frozen=True)
class Bool:
    def __call__(self, v) -> str | None:
        return None if isinstance(v, bool) else "needs True or False"


@dataclasses.dataclass(frozen=True)
class Choice:
    """One of a fixed tuple of names, or of a registry's names (`names` is then a function,
    called when checked, so registries fill up on import first)."""

    names: tuple[str, ...] | Callable[[], tuple[str, ...]]
    note: str = ""

    def __call__(self, v) -> str | None:
        names = self.names() if callable(self.names) else self.names
        if isinstance(v, str) and v in names:
            return None
        return _with_note(f"needs one of {', '.join(names)}", self.note)


@dataclasses.dataclass(frozen=True)
class Text:
    """A string, optionally non-empty."""

    nonempty: bool = False
    note: str = ""

    def __call__(self, v) -> str | None:
        if not isinstance(v, str) or (self.nonempty and not v.strip()):
            return _with_note("needs a non-empty string" if self.nonempty else "needs a string",
                              self.note)
        return None


@dataclasses.dataclass(frozen=True)
class Check:
    """Any other value check: `fn(value)` returns the problem, or None."""

    fn: Callable[[Any], str | None]

    def __call__(self, v) -> str | None:
        return self.fn(v)


def _bounds(lo, hi) -> str:
    if lo is not None and hi is not None:
        return f" in [{lo}, {hi}]"
    if lo is not None:
        return f" >= {lo}"
    return "" if hi is None else f" <= {hi}"


def _with_note(text: str, note: str) -> str:
    return f"{text} ({note})" if note else text


# -- checks that need a registry or the file system --------------------------------------------


def _algorithm(v) -> str | None:
    if not isinstance(v, str) or not v:
        return "needs a registered algorithm's name or package.module:step"
    from hfjax.algorithms.registry import get_algorithm

    try:  # a user algorithm's module is imported here, registering what it brings
        get_algorithm(v)
    except ValueError as err:
        return str(err)
    return None


def _registry(name: str) -> Callable[[], tuple[str, ...]]:
    def names() -> tuple[str, ...]:
        from hfjax.numerics import core

        return getattr(core, name).names()

    return names


def _kl_names() -> tuple[str, ...]:
    from hfjax.numerics import core

    return core.KL_PENALTIES.names()


def _kl_controllers() -> tuple[str, ...]:
    from hfjax.numerics.losses import KL_CONTROLLERS

    return tuple(sorted(KL_CONTROLLERS))


def _corruptions() -> tuple[str, ...]:
    from hfjax.data.arith import CORRUPTIONS

    return CORRUPTIONS


def _layout_rules() -> tuple[str, ...]:
    from hfjax.parallel.sharding import RULE_SETS

    return ("auto", *RULE_SETS)


def _remat_policies() -> tuple[str, ...]:
    from hfjax.models.config import REMAT_POLICIES

    return (*REMAT_POLICIES, "auto")


def _attention_impls() -> tuple[str, ...]:
    from hfjax.models.config import ATTENTION_IMPLS

    return ATTENTION_IMPLS


def _mesh(optional: bool) -> Callable[[Any], str | None]:
    def check(v) -> str | None:
        if optional and v == "":
            return None
        from hfjax.parallel.mesh import MeshSpec

        try:
            MeshSpec.parse(v)
        except (TypeError, ValueError) as err:
            return str(err)
        return None

    return check


def _placement(v) -> str | None:
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


def _model_path(optional: bool, preset: bool = False) -> Callable[[Any], str | None]:
    def check(v) -> str | None:
        if v is None or v == "":
            return None if optional else "needs an HF model directory or a .gguf file"
        if not isinstance(v, str):
            return "needs a path string"
        if preset and v.startswith("preset:"):
            return _preset_problem(v)
        if v.endswith(".gguf"):
            return None if os.path.isfile(v) else "no such .gguf file"
        if os.path.isfile(v):
            return "is a file but not a .gguf; pass a .gguf file or an HF model directory"
        if not os.path.isdir(v):
            return "no such file or directory"
        if not os.path.isfile(os.path.join(v, "config.json")):
            return "has no config.json; is it an HF model directory?"
        return None

    return check


def _model_or_run(v) -> str | None:
    """A model (`_model_path`) or a training run's directory (launch.evaluate's --model)."""
    if isinstance(v, str) and os.path.isdir(v) and not os.path.isfile(
            os.path.join(v, "config.json")):
        from hfjax.checkpoint import is_run

        if is_run(v):
            return None
        return ("is neither an HF model directory (no config.json) nor a training run (no "
                "checkpoints); pass a model directory, a .gguf file or a run's out_dir")
    return _model_path(optional=True, preset=True)(v)


def _preset_problem(path: str) -> str | None:
    from hfjax.models import presets

    try:
        presets.get_preset(presets.preset_name(path))
    except ValueError as err:
        return str(err)
    return None


def _target_name(v) -> str | None:
    if v is None:
        return None
    from hfjax.parallel import targets

    try:
        targets.get_target(v)
    except ValueError as err:
        return str(err)
    return None


def _existing(kind: str, optional: bool = False) -> Callable[[Any], str | None]:
    def check(v) -> str | None:
        if optional and (v is None or v == ""):
            return None
        if not isinstance(v, str) or not v:
            return f"needs the path of an existing {kind}"
        test = os.path.isdir if kind == "directory" else os.path.exists
        return None if test(v) else f"no such {kind}"

    return check


def _output_dir(v) -> str | None:
    if not isinstance(v, str) or not v.strip():
        return "needs a directory path"
    if os.path.exists(v) and not os.path.isdir(v):
        return "is an existing file, not a directory; choose another path"
    return None


def _parquet_files(v) -> str | None:
    if not isinstance(v, str):
        return "needs comma-separated parquet paths"
    missing = [p for p in _split(v) if not os.path.isfile(p)]
    return f"no such file: {', '.join(missing)}" if missing else None


def _custom_reward(v) -> str | None:
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


def _spec(v) -> str | None:
    if v == "":
        return None
    from hfjax.algorithms.registry import import_spec

    try:
        fn = import_spec(v) if isinstance(v, str) else None
    except ValueError as err:
        return str(err)
    return None if callable(fn) else "needs package.module:function or path/to/file.py:function"


def _source_weights(v) -> str | None:
    from hfjax.workers.reward import parse_source_weights

    try:
        parse_source_weights(v)
    except ValueError as err:
        return str(err)
    return None


def _rm_targets() -> tuple[str, ...]:
    from hfjax.data.preferences import TARGETS

    return tuple(TARGETS)


def _sinks(v) -> str | None:
    from hfjax.metrics import parse_sink_names

    try:
        parse_sink_names(v)
    except ValueError as err:
        return str(err)
    return None


def _resume(v) -> str | None:
    v = str(v)
    if v in ("auto", "disable") or os.path.isdir(v):
        return None
    return ("not auto, disable or an existing checkpoint directory (a run's out_dir, "
            "checkpoint root or step dir)")


def _cache_dir(v) -> str | None:
    if not isinstance(v, str) or not v:
        return "needs 'auto', 'off' or a directory"
    if v not in ("auto", "off") and os.path.exists(v) and not os.path.isdir(v):
        return "is a file; give a directory, 'auto' or 'off'"
    return None


def _json_object(v) -> str | None:
    try:
        parsed = json.loads(v)
    except (TypeError, json.JSONDecodeError) as err:
        return f"is not JSON ({err})"
    return None if isinstance(parsed, dict) else "needs a JSON object, e.g. '{\"size\": 3}'"


def _prompts(v) -> str | None:
    if not v or not all(isinstance(p, str) and p.strip() for p in v):
        return "needs at least one non-empty prompt"
    return None


def _split(files: str) -> list[str]:
    return [f.strip() for f in files.split(",") if f.strip()]


# -- the train config --------------------------------------------------------------------------

_FRACTION = Float(0.0, 1.0)
_LR = Float(0.0, note="0 freezes the model")
_CLIP = Float(0.0)
_BUDGET = ("tokens per data-parallel device and micro-batch with use_remove_padding; "
           "0: ppo_micro_batch_size padded rows")
_SP = Choice(("ulysses", "ring"), note="attention across a row split over the mesh's sequence "
             "axis: ulysses (all-to-all, needs kv heads divisible by the sequence size) or ring "
             "(K/V blocks passed round)")
_FORWARD_BUDGET = ("tokens per data-parallel device and micro-batch of the scoring pass with "
                   "use_remove_padding; 0: the whole batch")

TRAIN_KEYS: dict[str, Callable[[Any], str | None]] = {
    # First: a user algorithm's module, imported by this check, may register estimators,
    # losses and the rows of its own config keys that later checks look up.
    "algorithm": Check(_algorithm),
    "seed": Int(0),
    "placement": Check(_placement),
    # model
    "model.path": Check(_model_path(optional=True, preset=True)),
    "model.tokenizer": Check(_existing("tokenizer directory or .gguf file", optional=True)),
    "model.vocab_size": Int(0, note="0: the tokenizer's size"),
    "model.hidden_size": Int(1),
    "model.intermediate_size": Int(1),
    "model.num_layers": Int(1),
    "model.num_heads": Int(1),
    "model.num_kv_heads": Int(1),
    "model.head_dim": Int(2),
    "model.dtype": Choice(("float32", "bfloat16", "auto"), note="compute; auto: bfloat16 on "
                          "GPUs, TPUs and AMX CPUs for hidden >= 512, else float32"),
    "model.param_dtype": Choice(("float32", "bfloat16"), note="master weights and optimizer "
                                "state"),
    "model.scan_layers": Bool(),
    "model.remat_policy": Choice(_remat_policies),
    "model.attention_impl": Choice(_attention_impls, note="auto: dense on CPU, cudnn on GPU, "
                                   "splash on TPU; blockwise where those cannot run"),
    # data
    "data.task": Choice(("arith", "parquet")),
    "data.train_files": Check(_parquet_files),
    "data.val_files": Check(_parquet_files),
    "data.n_train": Int(1),
    "data.n_test": Int(1),
    "data.train_batch_size": Int(1),
    "data.max_b": Int(1),
    "data.max_prompt_length": Int(1),
    # warm start
    "sft.steps": Int(0, note="0: no warm start"),
    "sft.batch_size": Int(1),
    "sft.micro_batch_size": Int(1),
    "sft.lr": _LR,
    "sft.corruption": Choice(_corruptions),
    "sft.corrupt_frac": _FRACTION,
    # python -m launch.sft on SFT parquet (hfjax.data.sft); empty: the task's demonstrations
    "sft.train_files": Check(_parquet_files),
    "sft.val_files": Check(_parquet_files),
    "sft.prompt_key": Text(nonempty=True),
    "sft.response_key": Text(nonempty=True),
    "sft.messages_key": Text(nonempty=True),
    "sft.max_response_length": Int(0, note="0: rollout.response_length"),
    "sft.scratchpad_lines": Int(0, 1000, note="arith demonstrations: lines of worked "
                                              "scratchpad before the answer (0: none)"),
    # actor
    "actor.mesh": Check(_mesh(optional=False)),
    "actor.rules": Choice(_layout_rules),
    "actor.sequence_parallel": _SP,
    "actor.lr": _LR,
    "actor.weight_decay": Float(0.0),
    "actor.grad_clip": Float(0.0, note="0: no clipping"),
    "actor.ppo_mini_batch_size": Int(1),
    "actor.ppo_micro_batch_size": Int(1),
    "actor.use_remove_padding": Bool(),
    "actor.group_by_length": Bool(),
    "actor.share_prompt": Bool(),
    "actor.ppo_max_token_len_per_gpu": Int(0, note=_BUDGET),
    "actor.logprob_chunk": Int(0, note="positions per data-parallel device the LM head takes "
                                       "at a time in log-probs and entropy (0: whole rows)"),
    "actor.ppo_epochs": Int(1),
    "actor.shuffle": Bool(),
    "actor.policy_loss": Choice(_registry("POLICY_LOSSES")),
    "actor.clip_ratio": _CLIP,
    "actor.clip_ratio_low": _CLIP,
    "actor.clip_ratio_high": _CLIP,
    "actor.clip_ratio_c": Float(1.0, lo_open=True, note="the dual-clip bound"),
    "actor.loss_agg_mode": Choice(_registry("LOSS_AGG_MODES")),
    "actor.entropy_coeff": Float(),
    "actor.use_kl_loss": Bool(),
    "actor.kl_loss_coef": Float(0.0),
    "actor.kl_loss_type": Choice(_kl_names),
    # rollout
    "rollout.mesh": Check(_mesh(optional=True)),
    "rollout.hybrid_engine": Bool(),
    "rollout.offload_optimizer": Bool(),
    "rollout.n": Int(1),
    "rollout.temperature": Float(0.0, lo_open=True,
                                 note="training log-probs are divided by it; greedy "
                                      "validation is rollout.val_kwargs.temperature=0"),
    "rollout.top_k": Int(0, note="0: off"),
    "rollout.top_p": Float(0.0, 1.0, lo_open=True, note="1.0: off"),
    "rollout.min_p": Float(0.0, 1.0, hi_open=True, note="0.0: off"),
    "rollout.response_length": Int(1),
    "rollout.mode": Choice(("static", "continuous"),
                           note="continuous: decode slots refilled as rows stop"),
    "rollout.slots": Int(0, note="0: one per sample"),
    "rollout.decode_attention": Choice(("auto", "full", "chunked", "pallas"),
                                       note="auto: full on CPU, chunked on GPU and TPU"),
    "rollout.kv_layout": Choice(("auto", "cpu", "gpu"), note="auto: the platform's"),
    "rollout.refill_every": Int(1),
    "rollout.min_slots": Int(0, note="0: the start of the slots' row range"),
    "rollout.max_cache_len": Int(0, note="0: no limit"),
    "rollout.val_kwargs.n": Int(1),
    "rollout.val_kwargs.temperature": Float(0.0, note="0: greedy"),
    # reference and critic
    "ref.mesh": Check(_mesh(optional=False)),
    "ref.sequence_parallel": _SP,
    "critic.mesh": Check(_mesh(optional=False)),
    "critic.sequence_parallel": _SP,
    "critic.lr": _LR,
    "critic.weight_decay": Float(0.0),
    "critic.grad_clip": Float(0.0, note="0: no clipping"),
    "critic.ppo_mini_batch_size": Int(1),
    "critic.ppo_micro_batch_size": Int(1),
    "critic.use_remove_padding": Bool(),
    "critic.group_by_length": Bool(),
    "critic.ppo_max_token_len_per_gpu": Int(0, note=_BUDGET),
    "critic.ppo_epochs": Int(1),
    "critic.shuffle": Bool(),
    "critic.cliprange_value": Float(0.0, lo_open=True),
    "critic.loss_agg_mode": Choice(_registry("LOSS_AGG_MODES")),
    # Safe-RLHF's cost critic
    "cost_critic.mesh": Check(_mesh(optional=False)),
    "cost_critic.sequence_parallel": _SP,
    "cost_critic.lr": _LR,
    "cost_critic.weight_decay": Float(0.0),
    "cost_critic.grad_clip": Float(0.0, note="0: no clipping"),
    "cost_critic.ppo_mini_batch_size": Int(1),
    "cost_critic.ppo_micro_batch_size": Int(1),
    "cost_critic.use_remove_padding": Bool(),
    "cost_critic.group_by_length": Bool(),
    "cost_critic.ppo_max_token_len_per_gpu": Int(0, note=_BUDGET),
    "cost_critic.ppo_epochs": Int(1),
    "cost_critic.shuffle": Bool(),
    "cost_critic.cliprange_value": Float(0.0, lo_open=True),
    "cost_critic.loss_agg_mode": Choice(_registry("LOSS_AGG_MODES")),
    # advantages and KL
    "algo.adv_estimator": Choice(_registry("ADV_ESTIMATORS")),
    "algo.gamma": _FRACTION,
    "algo.lam": _FRACTION,
    "algo.norm_adv_by_std_in_grpo": Bool(),
    "algo.use_kl_in_reward": Bool(),
    "algo.kl_penalty": Choice(_kl_names),
    "algo.kl_ctrl.type": Choice(_kl_controllers),
    "algo.kl_ctrl.kl_coef": Float(0.0),
    "algo.kl_ctrl.target_kl": Float(0.0, lo_open=True),
    "algo.kl_ctrl.horizon": Float(0.0, lo_open=True),
    # Safe-RLHF's Lagrange multiplier (hfjax.numerics.losses.LagrangeMultiplier)
    "algo.safe_rlhf.cost_threshold": Float(),
    "algo.safe_rlhf.lambda_init": Float(0.0, lo_open=True),
    "algo.safe_rlhf.lambda_lr": Float(0.0, lo_open=True),
    "algo.safe_rlhf.lambda_max": Float(0.0, lo_open=True),
    # DAPO's dynamic sampling and overlong shaping (hfjax.algorithms.dapo)
    "algo.filter_groups.enable": Bool(),
    "algo.filter_groups.max_num_gen_batches": Int(0, note="0: no cap"),
    "algo.filter_groups.on_exhausted": Choice(("error", "fill")),
    "algo.overlong_buffer.enable": Bool(),
    "algo.overlong_buffer.len": Int(1),
    "algo.overlong_buffer.penalty_factor": Float(0.0),
    # rewards
    "reward.custom_fn": Check(_custom_reward),
    "reward.num_processes": Int(0, note="0: score in the controller, without timeouts"),
    "reward.timeout_s": Float(0.0, lo_open=True),
    "reward.rule_weight": Float(),
    "reward.model_weight": Float(),
    "reward.sources": Check(_source_weights),
    # learned reward and cost models (HF *ForSequenceClassification directories)
    "reward_model.path": Check(_model_path(optional=True)),
    "reward_model.mesh": Check(_mesh(optional=False)),
    "reward_model.sequence_parallel": _SP,
    "reward_model.dtype": Choice(("float32", "bfloat16")),
    "reward_model.use_remove_padding": Bool(),
    "reward_model.forward_max_token_len_per_gpu": Int(0, note=_FORWARD_BUDGET),
    "cost_model.path": Check(_model_path(optional=True)),
    "cost_model.mesh": Check(_mesh(optional=False)),
    "cost_model.sequence_parallel": _SP,
    "cost_model.dtype": Choice(("float32", "bfloat16")),
    "cost_model.use_remove_padding": Bool(),
    "cost_model.forward_max_token_len_per_gpu": Int(0, note=_FORWARD_BUDGET),
    "cost_model.reference_fn": Check(_spec),
    # python -m launch.train_rm (hfjax.rm)
    "rm.target": Choice(_rm_targets),
    "rm.train_files": Check(_parquet_files),
    "rm.val_files": Check(_parquet_files),
    "rm.max_response_length": Int(0, note="0: rollout.response_length"),
    "rm.steps": Int(1),
    "rm.batch_size": Int(1),
    "rm.micro_batch_size": Int(1),
    "rm.lr": _LR,
    "rm.weight_decay": Float(0.0),
    "rm.grad_clip": Float(0.0, note="0: no clipping"),
    "rm.sign_coef": Float(0.0, note="Safe-RLHF's cost-sign term; needs unsafe labels"),
    "rm.center_coef": Float(0.0),
    "rm.mesh": Check(_mesh(optional=False)),
    "rm.eval_every": Int(0, note="0: only before and after"),
    # the run
    "trainer.total_steps": Int(0),
    "trainer.test_freq": Int(0, note="0: never"),
    "trainer.val_before_train": Bool(),
    "trainer.sync_stage_timing": Bool(),
    "trainer.log_every": Int(0, note="0: validation lines only"),
    "trainer.logger": Check(_sinks),
    "trainer.project_name": Text(),
    "trainer.experiment_name": Text(),
    "trainer.plot": Bool(),
    "trainer.jax_smi": Bool(),
    "trainer.out_dir": Check(_output_dir),
    "trainer.save_freq": Int(note="<= 0: only at a stop signal"),
    "trainer.max_to_keep": Int(0, note="0: keep every checkpoint"),
    "trainer.async_save": Bool(),
    "trainer.resume": Check(_resume),
    "trainer.nonfinite": Choice(("stop", "skip"),
                                note="what an update with a non-finite loss or gradient does"),
    "trainer.compilation_cache_dir": Check(_cache_dir),
    # Read by launch.plan only (hfjax.planner.config.plan_inputs); the runs ignore them.
    "plan.score_micro": Int(0, note="rows per scoring pass the planner models; 0: the whole "
                            "batch"),
    "plan.gen_rows": Int(-1, note="rows per decode replica the planner models; 0: all, -1: "
                         "the planner picks"),
}

# Keys whose value is a mapping that is not itself a section of keys.
_LEAF_MAPPINGS = ("placement",)


def register_keys(rows: Mapping[str, Callable[[Any], str | None]]) -> None:
    """Adds rows to `TRAIN_KEYS` for the config keys of a user algorithm's own roles (e.g.
    {"probe.mesh": Check(...)}), so that configs setting them are accepted; a key hfjax already
    declares is refused unless its check is the same object (a module imported twice)."""
    for key, check in rows.items():
        if key in TRAIN_KEYS and TRAIN_KEYS[key] is not check:
            raise ValueError(f"config key {key} is already declared in hfjax/run_config.py")
        TRAIN_KEYS[key] = check
        _OPTIONAL_KEYS.add(key)


# Keys registered by user modules, and launch.plan's own (the runs never read them): a config
# without them is still complete.
_OPTIONAL_KEYS: set[str] = {"plan.score_micro", "plan.gen_rows"}


def run_roles(algo, cfg) -> tuple[str, ...]:
    """The algorithm's roles plus those the config selects: a reward model
    (`reward_model.path`) scores for any algorithm with a reward. A cost model is part of an
    algorithm that uses costs (Safe-RLHF); configuring one for another algorithm is a
    ValueError, since nothing would read it."""
    roles = list(algo.roles)
    rm = cfg.get("reward_model")
    if rm is not None and rm.path and "reward" in roles and "reward_model" not in roles:
        roles.append("reward_model")
    cm = cfg.get("cost_model")
    if cm is not None and cm.path and "cost_model" not in roles:
        raise ValueError(f"cost_model.path is set but algorithm {algo.name!r} has no cost; "
                         "unset it, or use an algorithm with a cost model (safe_rlhf)")
    return tuple(roles)


# Roles whose model a config selects by a path (a trained score head).
MODEL_ROLES = ("reward_model", "cost_model")


def _roles(c) -> tuple:
    from hfjax.algorithms.registry import get_algorithm

    algo = get_algorithm(c.algorithm)
    return algo, run_roles(algo, c)


def _selected_models(c) -> str | None:
    try:
        _roles(c)
    except ValueError as err:
        return str(err)
    return None


def _algorithm_settings(c) -> str | None:
    from hfjax.algorithms.registry import get_algorithm

    algo = get_algorithm(c.algorithm)
    if algo.check is None:
        return None
    try:  # the algorithm's own refusals (DAPO with a KL term, Safe-RLHF without a cost model)
        algo.check(c)
    except ValueError as err:
        return str(err)
    return None


def _group_needs_samples(c) -> str | None:
    from hfjax.numerics import core

    estimator = c.algo.adv_estimator
    if core.ADV_ESTIMATORS.info(estimator).get("group") and c.rollout.n < 2:
        return (f"algo.adv_estimator={estimator!r} compares the samples of each prompt, but "
                f"rollout.n={c.rollout.n} draws one; set --config.rollout.n to 2 or more "
                "(e.g. 8)")
    return None


def _score_models(c) -> str | None:
    from hfjax.models.hf_io import check_score_checkpoint

    _, roles = _roles(c)
    for role in MODEL_ROLES:
        if role in roles:
            try:  # reads config.json and the safetensors headers only
                check_score_checkpoint(c[role].path, f"{role}.path")
            except (ValueError, OSError) as err:
                return str(err)
    return None


def _estimator_inputs(c) -> str | None:
    from hfjax.numerics import core

    algo, _ = _roles(c)
    need = core.ADV_ESTIMATORS.info(c.algo.adv_estimator).get("needs", ())
    # What the algorithm's dataflow produces, as it registered it (a critic's values are
    # PPO's `provides`); the roles a config adds (a reward model) produce none of these.
    missing = [k for k in need if k not in algo.provides]
    if missing:
        return (f"algo.adv_estimator={c.algo.adv_estimator!r} needs {', '.join(missing)}, which "
                f"algorithm {algo.name!r} does not produce; choose another estimator or an "
                "algorithm that produces them")
    return None


def _kl_needs_a_reference(c) -> str | None:
    algo, roles = _roles(c)
    if "ref" not in roles and (c.actor.use_kl_loss or c.algo.use_kl_in_reward):
        return (f"algorithm {algo.name!r} has no reference policy, so it has no KL term; set "
                "--config.actor.use_kl_loss=False and --config.algo.use_kl_in_reward=False")
    return None


def _data_files(c) -> str | None:
    d = c.data
    if d.task == "parquet":
        for key in ("train_files", "val_files"):
            if not _split(d[key]):
                return (f"data.task='parquet' needs data.{key}: set "
                        f"--config.data.{key}=path/to/{key.split('_')[0]}.parquet "
                        "(launch.prepare_data writes them)")
    elif d.train_files or d.val_files:
        return ("data.train_files/val_files are set but data.task='arith' ignores them; set "
                "--config.data.task=parquet to train on them")
    return None


def _warm_start_needs_arith(c) -> str | None:
    if c.sft.steps > 0 and c.data.task != "arith":
        return (f"sft.steps={c.sft.steps}: the warm start uses the arith task's "
                f"demonstrations, and data.task={c.data.task!r}; set --config.sft.steps=0")
    return None


def _sft_micro_batches(c) -> str | None:
    s = c.sft
    if s.steps > 0 and s.batch_size % s.micro_batch_size:
        return (f"sft.micro_batch_size={s.micro_batch_size} does not divide "
                f"sft.batch_size={s.batch_size}; pick a divisor")
    return None


def _arith_sizes(c) -> str | None:
    d = c.data
    if d.task == "arith" and d.n_train < d.train_batch_size:
        return (f"data.n_train={d.n_train} is smaller than one batch "
                f"(data.train_batch_size={d.train_batch_size}); raise n_train or lower the batch")
    return None


def _mini_batches_fit(c) -> str | None:
    _, roles = _roles(c)
    for role in ("actor", "critic", "cost_critic"):
        if role not in roles:
            continue
        s = c[role]
        if s.ppo_mini_batch_size > c.data.train_batch_size:
            return (f"{role}.ppo_mini_batch_size={s.ppo_mini_batch_size} prompts is more than "
                    f"data.train_batch_size={c.data.train_batch_size}; lower it")
    return None


def _scratch_model(c) -> str | None:
    m = c.model
    if m.path:
        return None  # the sizes below are ignored; the checkpoint's config is used
    if m.num_heads % m.num_kv_heads:
        return (f"model.num_heads={m.num_heads} is not a multiple of model.num_kv_heads="
                f"{m.num_kv_heads}; grouped-query attention needs whole groups")
    if m.head_dim % 2:
        return f"model.head_dim={m.head_dim} must be even (rotary embeddings pair dimensions)"
    if m.vocab_size:
        from hfjax.data import arith

        need = arith.tokenizer().vocab_size
        if m.vocab_size < need:
            return (f"model.vocab_size={m.vocab_size} is smaller than the tokenizer's {need}; "
                    "set 0 (the tokenizer's size) or more")
    return None


def _positions(c) -> str | None:
    """Whether the policy and the reward and cost models (each a path) hold a whole sequence:
    the longest prompt plus the longest response, in positions."""
    need = c.data.max_prompt_length + c.rollout.response_length
    for key in ("model", "reward_model", "cost_model"):
        section = c.get(key)
        path = section.get("path", "") if section is not None else ""
        if not path:
            continue  # none, or a model from scratch (sized to hold them)
        try:
            limit = _max_positions(path)
        except (OSError, ValueError, KeyError) as err:
            return f"{key}.path={path!r}: cannot read its config ({err})"
        if need > limit:
            return (f"data.max_prompt_length + rollout.response_length = {need} positions, more "
                    f"than {key}.path's max_position_embeddings={limit}; shorten them, or use "
                    f"a model with a longer context")
    return None


def _max_positions(path: str) -> int:
    """The max_position_embeddings of a preset, a .gguf file or an HF model directory."""
    from hfjax.models.config import ModelConfig

    if path.startswith("preset:"):
        from hfjax.models import presets

        return presets.get_preset(presets.preset_name(path)).max_position_embeddings
    if path.endswith(".gguf"):
        from hfjax.models.gguf_io import read_gguf_config

        hf = read_gguf_config(path)
    else:
        with open(os.path.join(path, "config.json")) as f:
            hf = json.load(f)
    return ModelConfig.from_hf_config(hf).max_position_embeddings


def _adaptive_kl(c) -> str | None:
    k = c.algo.kl_ctrl
    if k.type == "adaptive" and not c.algo.use_kl_in_reward:
        return ("algo.kl_ctrl.type='adaptive' adapts the KL-in-reward coefficient, and "
                "algo.use_kl_in_reward=False; set it to True or use type 'fixed'")
    return None


def _slot_cache(c) -> str | None:
    r = c.rollout
    need = c.data.max_prompt_length + r.response_length
    if r.mode == "continuous" and r.max_cache_len and r.max_cache_len < need:
        return (f"rollout.max_cache_len={r.max_cache_len} cache columns per slot cannot hold a "
                f"request of data.max_prompt_length + rollout.response_length = {need} tokens; "
                f"set --config.rollout.max_cache_len={need} or more, or 0 (no limit)")
    return None


def _token_budget(c) -> str | None:
    need = c.data.max_prompt_length + c.rollout.response_length
    for role, key, zero in (("actor", "ppo_max_token_len_per_gpu", "ppo_micro_batch_size"),
                            ("critic", "ppo_max_token_len_per_gpu", "ppo_micro_batch_size"),
                            ("cost_critic", "ppo_max_token_len_per_gpu", "ppo_micro_batch_size"),
                            ("reward_model", "forward_max_token_len_per_gpu", None),
                            ("cost_model", "forward_max_token_len_per_gpu", None)):
        s = c.get(role)
        if s is None or key not in s:
            continue
        budget = s[key]
        if s.use_remove_padding and budget and budget < need:
            zero = f"{role}.{zero} padded rows' worth" if zero else "the whole batch's tokens"
            return (f"{role}.{key}={budget} tokens is smaller than one sequence "
                    f"(data.max_prompt_length + rollout.response_length = {need}); set "
                    f"--config.{role}.{key}={need} or more, or 0 ({zero})")
    return None


def _one_length_layout(c) -> str | None:
    for role in ("actor", "critic", "cost_critic"):
        s = c.get(role)
        if s is not None and s.get("group_by_length") and s.get("use_remove_padding"):
            return (f"{role}.group_by_length and {role}.use_remove_padding both cut micro-batches "
                    f"to real tokens (grouped padded rows vs packed rows); set one of them to "
                    f"False, e.g. --config.{role}.use_remove_padding=False")
    return None


TRAIN_RULES: tuple[Callable[[Any], str | None], ...] = (
    _selected_models,
    _estimator_inputs,
    _group_needs_samples,
    _algorithm_settings,  # before the generic KL rule: its message is the algorithm's own
    _kl_needs_a_reference,
    _score_models,
    _data_files,
    _warm_start_needs_arith,
    _sft_micro_batches,
    _arith_sizes,
    _mini_batches_fit,
    _scratch_model,
    _adaptive_kl,
    _positions,
    _slot_cache,
    _token_budget,
    _one_length_layout,
)


# -- the other entry points' flags -------------------------------------------------------------

_CACHE = Check(_cache_dir)

FLAG_KEYS: dict[str, dict[str, Callable[[Any], str | None]]] = {
    "train": {
        "cpu_devices": Int(0, note="0: leave XLA_FLAGS alone"),
        "target": Check(_target_name),
        "num_devices": Int(1),
        "device_memory_gib": Check(lambda v: None if v is None or v > 0 else "needs a "
                                   "positive number of GiB"),
    },
    "sft": {"cpu_devices": Int(0, note="0: leave XLA_FLAGS alone")},
    "evaluate": {
        "cpu_devices": Int(0, note="0: leave XLA_FLAGS alone"),
        "model": Check(_model_or_run),
        "step": Check(lambda v: None if v is None else Int(0)(v)),
        "data": Check(lambda v: None if v is None else _parquet_files(v)),
        "samples": Int(1),
        "temperature": Float(0.0, lo_open=True),
        "limit": Int(0, note="0: every prompt"),
    },
    "train_rm": {"cpu_devices": Int(0, note="0: leave XLA_FLAGS alone")},
    "generate": {
        "model": Check(_model_path(optional=True)),
        "prompt": Check(_prompts),
        "max_new_tokens": Int(1),
        "temperature": Float(0.0, note="0: greedy"),
        "top_k": Int(0, note="0: off"),
        "top_p": Float(0.0, 1.0, lo_open=True, note="1: off"),
        "min_p": Float(0.0, 1.0, hi_open=True, note="0: off"),
        "n": Int(1),
        "seed": Int(0),
        "mesh": Check(lambda v: None if v is None else _mesh(optional=False)(v)),
        "compilation_cache_dir": _CACHE,
    },
    "convert": {
        "src": Check(_model_path(optional=False)),
        "dst": Check(_output_dir),
        "compilation_cache_dir": _CACHE,
    },
    "export": {
        "ckpt": Check(_existing("directory")),
        "out": Check(_output_dir),
        "step": Check(lambda v: None if v is None else Int(0)(v)),
        "tokenizer": Check(_existing("tokenizer directory or .gguf file", optional=True)),
        "compilation_cache_dir": _CACHE,
    },
    "prepare_data": {
        "n_train": Int(0),
        "n_test": Int(0),
        "out": Check(_output_dir),
        "seed": Int(0),
        "task_config": Check(_json_object),
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


def _step_needs_run(v) -> str | None:
    from hfjax.checkpoint import is_run

    step, model = v.get("step"), v.get("model")
    if step is not None and not (model and is_run(model)):
        return f"--step={step} picks a checkpoint, but --model is not a training run"
    return None


FLAG_RULES: dict[str, tuple[Callable[[Mapping[str, Any]], str | None], ...]] = {
    "convert": (_convert_target,),
    "export": (_export_target,),
    "evaluate": (_step_needs_run,),
    "prepare_data": (_some_rows,),
}


# -- running the checks -------------------------------------------------------------------------


def config_items(cfg, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) for every leaf of a (nested) config."""
    for k, v in cfg.items():
        key = prefix + k
        if hasattr(v, "items") and key not in _LEAF_MAPPINGS:
            yield from config_items(v, key + ".")
        else:
            yield key, v


def check_config(cfg) -> None:
    """Checks every key of a train config and every rule between keys, without devices and
    without writing anything; raises ConfigError naming the first problem."""
    items = dict(config_items(cfg))
    if "algorithm" in items:  # imports a user algorithm's module, which may register keys
        problem = TRAIN_KEYS["algorithm"](items["algorithm"])
        if problem:
            raise ConfigError(f"algorithm={items['algorithm']!r}: {problem}; set "
                              "--config.algorithm")
    unknown = [k for k in items if k not in TRAIN_KEYS]
    if unknown:
        k = unknown[0]
        close = difflib.get_close_matches(k, TRAIN_KEYS, n=1)
        hint = f"did you mean {close[0]}?" if close else "remove it"
        raise ConfigError(f"unknown config key {k}; {hint} (every key is declared in "
                          "hfjax/run_config.py TRAIN_KEYS)")
    missing = [k for k in TRAIN_KEYS if k not in items and k not in _OPTIONAL_KEYS]
    if missing:
        raise ConfigError(f"the config has no key {missing[0]}; derive configs from "
                          "configs/ppo_arith.py, which sets every key")
    for key, check in TRAIN_KEYS.items():
        if key not in items or key == "algorithm":
            continue  # an optional key left out, or checked above
        problem = check(items[key])
        if problem:
            raise ConfigError(f"{key}={items[key]!r}: {problem}; set --config.{key}")
    for rule in TRAIN_RULES:
        problem = rule(cfg)
        if problem:
            raise ConfigError(problem)


def check_flags(entry: str, values: Mapping[str, Any]) -> None:
    """Checks an entry point's flags (`FLAG_KEYS[entry]`, then `FLAG_RULES[entry]`); raises
    ConfigError naming the first problem."""
    for name, check in FLAG_KEYS.get(entry, {}).items():
        if name not in values:
            continue
        problem = check(values[name])
        if problem:
            raise ConfigError(f"--{name}={_show(values[name])}: {problem}")
    for rule in FLAG_RULES.get(entry, ()):
        problem = rule(values)
        if problem:
            raise ConfigError(problem)


def _show(v) -> str:
    if isinstance(v, (list, tuple)):
        return ",".join(map(str, v)) or "''"
    return "''" if v == "" else str(v)


def validate_config(cfg):
    """`check_config`, then the checks that need the devices: placement, meshes and batch
    splits. Returns (Algorithm, {role: ResourcePool})."""
    import jax

    from hfjax.algorithms.registry import get_algorithm
    from hfjax.controller.placement import resolve_placement
    from hfjax.engine.update import check_mini_batching
    from hfjax.parallel.mesh import MeshSpec, dp_size
    from hfjax.workers.groups import needs_ref

    check_config(cfg)
    algo = get_algorithm(cfg.algorithm)
    roles = run_roles(algo, cfg)
    n_seq = cfg.data.train_batch_size * cfg.rollout.n
    pools = resolve_placement(placement_of(cfg), active_roles(algo, cfg), jax.devices())
    dp = dp_size(MeshSpec.parse(cfg.actor.mesh).build(pools["actor"].devices, "actor"))
    check_mini_batching(n_seq, cfg.actor.ppo_mini_batch_size * cfg.rollout.n,
                        cfg.actor.ppo_micro_batch_size, dp, "actor")
    if cfg.sft.steps > 0:
        check_mini_batching(cfg.sft.batch_size, cfg.sft.batch_size, cfg.sft.micro_batch_size,
                            dp, "sft (warm start)")
    if needs_ref(cfg, roles):
        # Built only after the warm start, so a bad mesh must be caught here, not there.
        MeshSpec.parse(cfg.ref.mesh).build(pools["ref"].devices, "ref")
    for critic in ("critic", "cost_critic"):
        if critic in roles:
            c = cfg[critic]
            dpc = dp_size(MeshSpec.parse(c.mesh).build(pools[critic].devices, critic))
            check_mini_batching(n_seq, c.ppo_mini_batch_size * cfg.rollout.n,
                                c.ppo_micro_batch_size, dpc, critic)
    for role in MODEL_ROLES:
        if role in roles:
            MeshSpec.parse(cfg[role].mesh).build(pools[role].devices, role)
    return algo, pools


def placement_of(cfg):
    """The config's placement: a mode name or a plain {pool: {size, roles}} mapping."""
    p = cfg.placement
    return p.to_dict() if hasattr(p, "to_dict") else p


def active_roles(algo, cfg=None) -> tuple[str, ...]:
    """The roles that get a pool: the algorithm's, plus those `cfg` selects (`run_roles`)."""
    return algo.roles if cfg is None else run_roles(algo, cfg)

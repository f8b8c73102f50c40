"""The train config's key table: one row per key (`TRAIN_KEYS`), what a valid value is, and
`register_keys` for the keys of a user algorithm's own roles.

Each key is declared once. A key that a spec reads is declared by the spec's field, with its
check (`hfjax.settings.key`); `SPEC_SECTIONS` names each spec with the config section it is
read from, and their rows are gathered here (`hfjax.settings.spec_rows`). `HAND_KEYS` holds
the rows of the keys no spec reads (the run's, the data's, the meshes', the optimizers', the
adapters', ...); a key in both is refused at import (`merge_rows`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from hfjax.algorithms.spec import AlgoSpec
from hfjax.config.validators import (
    algorithm,
    attention_impls,
    cache_dir,
    corruptions,
    custom_reward,
    existing,
    judge_template,
    kl_controllers,
    layout_rules,
    mesh,
    model_path,
    output_dir,
    parquet_files,
    placement,
    preference_losses,
    remat_policies,
    resume,
    rm_targets,
    sinks,
    source_weights,
    spec,
    verdict_parser,
)
from hfjax.engine.spec import RolloutSpec
from hfjax.models.lora import LoraSpec
from hfjax.settings import Bool, Check, Choice, Float, Int, Text, spec_rows
from hfjax.workers.spec import ActorSpec, CriticSpec, ScoreSpec

_FRACTION = Float(0.0, 1.0)
_LR = Float(0.0, note="0 freezes the model")
_CLIP = Float(0.0)
_BUDGET = ("tokens per data-parallel device and micro-batch with use_remove_padding; "
           "0: ppo_micro_batch_size padded rows")
_SP = Choice(("ulysses", "ring"), note="attention across a row split over the mesh's sequence "
             "axis: ulysses (all-to-all, needs query heads divisible by the sequence size; kv "
             "heads are repeated where they are not) or ring (K/V blocks passed round)")
_FORWARD_BUDGET = ("tokens per data-parallel device and micro-batch of the scoring pass with "
                   "use_remove_padding; 0: the whole batch")

def _critic_rows(role: str) -> dict[str, Callable[[Any], str | None]]:
    """The rows of a value critic's section (PPO's critic, Safe-RLHF's cost critic)."""
    return {
        f"{role}.mesh": Check(mesh(optional=False)),
        f"{role}.sequence_parallel": _SP,
        f"{role}.lr": _LR,
        f"{role}.weight_decay": Float(0.0),
        f"{role}.grad_clip": Float(0.0, note="0: no clipping"),
    }


def _score_model_rows(role: str) -> dict[str, Callable[[Any], str | None]]:
    """The rows of a learned score model's section (reward_model, cost_model)."""
    return {
        f"{role}.mesh": Check(mesh(optional=False)),
        f"{role}.sequence_parallel": _SP,
    }


# The rows of the keys no spec reads.
HAND_KEYS: dict[str, Callable[[Any], str | None]] = {
    # First: a user algorithm's module, imported by this check, may register estimators,
    # losses and the rows of its own config keys that later checks look up.
    "algorithm": Check(algorithm),
    "seed": Int(0),
    "placement": Check(placement),
    # model
    "model.path": Check(model_path(optional=True, preset=True)),
    "model.tokenizer": Check(existing("tokenizer directory or .gguf file", optional=True)),
    "model.max_layers": Int(0, note="0: all of model.path's layers; N: its first N at most"),
    "model.vocab_size": Int(0, note="0: the tokenizer's size"),
    "model.hidden_size": Int(1),
    "model.intermediate_size": Int(1),
    "model.num_layers": Int(1),
    "model.num_heads": Int(1),
    "model.num_kv_heads": Int(1),
    "model.head_dim": Int(2),
    "model.dtype": Choice(("float32", "bfloat16", "auto"), note="compute; auto: bfloat16 on "
                          "GPUs, TPUs and CPUs with native bf16 multiplies (AMX, AVX-512 "
                          "BF16) for hidden >= 512, else float32 (hfjax.models.backend)"),
    "model.param_dtype": Choice(("float32", "bfloat16"), note="master weights and optimizer "
                                "state"),
    "model.scan_layers": Bool(),
    "model.remat_policy": Choice(remat_policies, note="auto: none, or full where the dry run "
                                 "without recomputation exceeds 90% of the device memory "
                                 "(hfjax.models.backend.remat_policy)"),
    "model.attention_impl": Choice(attention_impls, note="auto: dense on CPU, blockwise on "
                                   "GPU, splash on TPU; blockwise where cudnn or splash cannot "
                                   "run (hfjax.models.backend.attention_impl)"),
    "model.num_experts": Int(0, note="0: dense; > 0: a mixture of experts from scratch"),
    "model.num_experts_per_tok": Int(1),
    "model.moe_intermediate_size": Int(0, note="0: intermediate_size"),
    "model.moe_impl": Choice(("auto", "ragged", "capacity"), note="auto: ragged, the dropless "
                             "grouped matmul (hfjax.models.backend.moe_impl)"),
    "model.capacity_factor": Float(0.0, lo_open=True),
    "model.vision_depth": Int(0, note="0: text only; > 0: a Qwen2.5-VL-shaped vision tower of "
                              "that many blocks from scratch (docs/vision.md)"),
    "model.vision_hidden_size": Int(4),
    "model.vision_num_heads": Int(1),
    # data
    "data.task": Choice(("arith", "arith_chain", "arith_tool", "shapes", "parquet"),
                        note="arith_chain: a + chain_steps * b worked line by line; "
                        "arith_tool: 3-4 digit products, for the calculator; shapes: count "
                        "the red squares in a picture (a vision-language policy)"),
    # The control of a vision-language run: every picture white (docs/vision.md).
    "data.blank_images": Bool(),
    "data.train_files": Check(parquet_files),
    "data.val_files": Check(parquet_files),
    "data.n_train": Int(1),
    "data.n_test": Int(1),
    "data.train_batch_size": Int(1),
    "data.max_b": Int(1),
    "data.chain_steps": Int(1, 100, note="arith_chain: lines of the worked chain"),
    "data.max_prompt_length": Int(1),
    # True lets a test set share problems with training (logged); off: refused
    # (hfjax.data.holdout)
    "data.allow_overlap": Bool(),
    # warm start
    "sft.steps": Int(0, note="0: no warm start"),
    "sft.batch_size": Int(1),
    "sft.micro_batch_size": Int(1),
    "sft.lr": _LR,
    "sft.lr_schedule": Choice(("constant", "cosine"), note="cosine: from sft.lr to 0 over "
                              "sft.steps (the warm start inside RL)"),
    "sft.corruption": Choice(corruptions),
    "sft.corrupt_frac": _FRACTION,
    # python -m launch.sft on SFT parquet (hfjax.data.sft); empty: the task's demonstrations
    "sft.train_files": Check(parquet_files),
    "sft.val_files": Check(parquet_files),
    "sft.prompt_key": Text(nonempty=True),
    "sft.response_key": Text(nonempty=True),
    "sft.messages_key": Text(nonempty=True),
    "sft.max_response_length": Int(0, note="0: rollout.response_length"),
    "sft.heldout_generation": Bool(),
    "sft.scratchpad_lines": Int(0, 1000, note="arith demonstrations: lines of worked "
                                              "scratchpad before the answer (0: none)"),
    # actor
    "actor.mesh": Check(mesh(optional=False)),
    "actor.rules": Choice(layout_rules),
    # Keeps the vision tower out of the optimizer and the hybrid engine (docs/vision.md).
    "actor.freeze_vision": Bool(),
    "actor.sequence_parallel": _SP,
    "actor.lr": _LR,
    "actor.weight_decay": Float(0.0),
    "actor.grad_clip": Float(0.0, note="0: no clipping"),
    # rollout
    "rollout.val_kwargs.n": Int(1),
    "rollout.val_kwargs.temperature": Float(0.0, note="0: greedy"),
    # reference and critic
    "ref.mesh": Check(mesh(optional=False)),
    "ref.sequence_parallel": _SP,
    **_critic_rows("critic"),
    # Safe-RLHF's cost critic
    **_critic_rows("cost_critic"),
    # advantages and KL
    "algo.kl_ctrl.type": Choice(kl_controllers),
    "algo.kl_ctrl.kl_coef": Float(0.0),
    "algo.kl_ctrl.target_kl": Float(0.0, lo_open=True),
    "algo.kl_ctrl.horizon": Float(0.0, lo_open=True),
    # Safe-RLHF's Lagrange multiplier (hfjax.numerics.losses.LagrangeMultiplier)
    "algo.safe_rlhf.cost_threshold": Float(),
    "algo.safe_rlhf.lambda_init": Float(0.0, lo_open=True),
    "algo.safe_rlhf.lambda_lr": Float(0.0, lo_open=True),
    "algo.safe_rlhf.lambda_max": Float(0.0, lo_open=True),
    # rewards
    "reward.custom_fn": Check(custom_reward),
    "reward.num_processes": Int(0, note="0: score in the controller, without timeouts"),
    "reward.timeout_s": Float(0.0, lo_open=True),
    "reward.rule_weight": Float(),
    "reward.model_weight": Float(),
    "reward.judge_weight": Float(),
    "reward.sources": Check(source_weights),
    # the generative judge (hfjax.workers.judge)
    "reward.judge.path": Check(model_path(optional=True, preset=True)),
    "reward.judge.template": Check(judge_template),
    "reward.judge.parser": Check(verdict_parser),
    "reward.judge.max_verdict_tokens": Int(1),
    "reward.judge.default_score": Float(note="the score of a verdict that does not parse"),
    "reward.judge.timeout_s": Float(0.0, lo_open=True, note="per row's verdict parsing"),
    "reward.judge.mesh": Check(mesh(optional=False)),
    "reward.judge.dtype": Choice(("float32", "bfloat16")),
    # learned reward and cost models (HF *ForSequenceClassification directories)
    **_score_model_rows("reward_model"),
    **_score_model_rows("cost_model"),
    "cost_model.reference_fn": Check(spec),
    # on-policy distillation's teacher (algo.distill.coef > 0 or algorithm=opd)
    "teacher.path": Check(model_path(optional=True)),
    "teacher.mesh": Check(mesh(optional=False)),
    "teacher.sequence_parallel": _SP,
    "teacher.dtype": Choice(("float32", "bfloat16")),
    # python -m launch.train_rm (hfjax.run.rm)
    "rm.target": Choice(rm_targets),
    "rm.train_files": Check(parquet_files),
    "rm.val_files": Check(parquet_files),
    "rm.max_response_length": Int(0, note="0: rollout.response_length"),
    "rm.steps": Int(1),
    "rm.batch_size": Int(1),
    "rm.micro_batch_size": Int(1),
    "rm.lr": _LR,
    "rm.weight_decay": Float(0.0),
    "rm.grad_clip": Float(0.0, note="0: no clipping"),
    "rm.sign_coef": Float(0.0, note="Safe-RLHF's cost-sign term; needs unsafe labels"),
    "rm.center_coef": Float(0.0),
    "rm.mesh": Check(mesh(optional=False)),
    "rm.eval_every": Int(0, note="0: only before and after"),
    # python -m launch.train_dpo (hfjax.run.dpo)
    "dpo.loss_type": Choice(preference_losses),
    "dpo.beta": Float(0.0, lo_open=True),
    "dpo.label_smoothing": Float(0.0, 0.5),
    "dpo.simpo_gamma": Float(0.0),
    "dpo.train_files": Check(parquet_files),
    "dpo.val_files": Check(parquet_files),
    "dpo.max_response_length": Int(0, note="0: rollout.response_length"),
    "dpo.steps": Int(1),
    "dpo.batch_size": Int(1),
    "dpo.micro_batch_size": Int(1),
    "dpo.lr": _LR,
    "dpo.weight_decay": Float(0.0),
    "dpo.grad_clip": Float(0.0, note="0: no clipping"),
    "dpo.eval_every": Int(0, note="0: only before and after"),
    # asynchronous rollout (hfjax.run.async_loop)
    "async_rollout.max_staleness": Int(0, note="0: the synchronous loop; K >= 1: generation "
                                       "runs up to K updates ahead, on a rollout pool of its own"),
    "async_rollout.push_every": Int(1, note="updates between weight pushes to the rollout pool"),
    # rows still decoding at a push continue under the pushed weights (docs/async.md)
    "async_rollout.partial_rollout": Bool(),
    # the run
    "trainer.total_steps": Int(0),
    "trainer.test_freq": Int(0, note="0: never"),
    "trainer.val_before_train": Bool(),
    "trainer.sync_stage_timing": Bool(),
    "trainer.log_every": Int(0, note="0: validation lines only"),
    "trainer.logger": Check(sinks),
    "trainer.project_name": Text(),
    "trainer.experiment_name": Text(),
    "trainer.plot": Bool(),
    "trainer.jax_smi": Bool(),
    "trainer.out_dir": Check(output_dir),
    "trainer.save_freq": Int(note="<= 0: only at a stop signal"),
    "trainer.max_to_keep": Int(0, note="0: keep every checkpoint"),
    "trainer.async_save": Bool(),
    "trainer.resume": Check(resume),
    "trainer.nonfinite": Choice(("stop", "skip"),
                                note="what an update with a non-finite loss or gradient does"),
    "trainer.compilation_cache_dir": Check(cache_dir),
    # Read by launch.plan only (hfjax.planner.config.plan_inputs); the runs ignore them.
    "plan.score_micro": Int(0, note="rows per scoring pass the planner models; 0: the whole "
                            "batch"),
    "plan.gen_rows": Int(-1, note="rows per decode replica the planner models; 0: all, -1: "
                         "the planner picks"),
}

# Each spec and the config sections it is read from (`Spec.of(cfg.<section>)`, where the worker
# groups and the run's step are built): its fields are those sections' keys.
SPEC_SECTIONS: tuple[tuple[type, tuple[str, ...]], ...] = (
    (ActorSpec, ("actor",)),
    (RolloutSpec, ("rollout",)),
    (CriticSpec, ("critic", "cost_critic")),
    (AlgoSpec, ("algo",)),
    (ScoreSpec, ("reward_model", "cost_model")),
    (LoraSpec, ("actor.lora", "critic.lora", "cost_critic.lora")),
)


def merge_rows(hand: Mapping[str, Callable[[Any], str | None]],
               specs: tuple[tuple[type, tuple[str, ...]], ...],
               ) -> dict[str, Callable[[Any], str | None]]:
    """The key table: `hand`'s rows in order, each section's spec rows just before the first
    hand row of the same top-level section (so problems are reported section by section), or
    at the end. A key declared twice (a hand row and a spec field, or two specs) is refused:
    one declaration per key."""
    spec: dict[str, dict[str, Callable[[Any], str | None]]] = {}
    owner: dict[str, str] = {}
    for cls, sections in specs:
        for section in sections:
            for k, check in spec_rows(cls, section).items():
                if k in owner or k in hand:
                    where = owner.get(k, "a row of HAND_KEYS")
                    raise ValueError(f"config key {k} is declared twice: by {cls.__name__}."
                                     f"{k.rsplit('.', 1)[1]} and by {where}; keep one")
                owner[k] = f"{cls.__name__}.{k.rsplit('.', 1)[1]}"
                spec.setdefault(section.split(".")[0], {})[k] = check
    table: dict[str, Callable[[Any], str | None]] = {}
    for k, check in hand.items():
        table.update(spec.pop(k.split(".")[0], {}))
        table[k] = check
    for rows in spec.values():
        table.update(rows)
    return table


TRAIN_KEYS = merge_rows(HAND_KEYS, SPEC_SECTIONS)

# Keys whose value is a mapping that is not itself a section of keys.
LEAF_MAPPINGS = ("placement",)


def register_keys(rows: Mapping[str, Callable[[Any], str | None]]) -> None:
    """Adds rows to `TRAIN_KEYS` for the config keys of a user algorithm's own roles (e.g.
    {"probe.mesh": Check(...)}), so that configs setting them are accepted; a key hfjax already
    declares is refused unless its check is the same object (a module imported twice)."""
    for key, check in rows.items():
        if key in TRAIN_KEYS and TRAIN_KEYS[key] is not check:
            raise ValueError(f"config key {key} is already declared in hfjax/config/")
        TRAIN_KEYS[key] = check
        OPTIONAL_KEYS.add(key)


# Keys registered by user modules, and launch.plan's own (the runs never read them): a config
# without them is still complete.
OPTIONAL_KEYS: set[str] = {"plan.score_micro", "plan.gen_rows"}

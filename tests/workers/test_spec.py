"""The typed specs of the roles (hfjax/workers/spec.py), of the rollout (hfjax/engine/spec.py)
and of the algorithm's step (hfjax/algorithms/spec.py): read from a config section's keys,
frozen, and refusing a missing key or a wrong type by name."""

import dataclasses
import importlib
import pkgutil
import typing

import pytest

import configs
from configs import ppo_arith
from hfjax.algorithms import dataflow
from hfjax.algorithms.spec import (
    AlgoSpec,
    DistillSpec,
    FilterGroupsSpec,
    OverlongSpec,
    RolloutCorrectionSpec,
    StepSpec,
)
from hfjax.config.keys import TRAIN_KEYS
from hfjax.engine.packing import TokenBudget
from hfjax.engine.spec import MultiTurnSpec, RolloutSpec
from hfjax.workers.actor import ActorRollout, Reference
from hfjax.workers.critic import CostCritic, Critic
from hfjax.workers.spec import ActorSpec, CriticSpec, ScoreSpec

# (spec, the config sections it is read from)
SPECS = [(ActorSpec, ("actor",)), (CriticSpec, ("critic", "cost_critic")),
         (ScoreSpec, ("reward_model", "cost_model")), (RolloutSpec, ("rollout",)),
         (AlgoSpec, ("algo",))]


def test_the_actor_spec_holds_the_default_configs_values():
    a = ActorSpec.of(ppo_arith.get_config().actor)
    assert a == ActorSpec(
        ppo_mini_batch_size=64, ppo_micro_batch_size=64, ppo_epochs=1, shuffle=True,
        use_remove_padding=False, ppo_max_token_len_per_gpu=0, group_by_length=False,
        share_prompt=True, logprob_chunk=2048, policy_loss="vanilla", clip_ratio=0.2,
        clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, loss_agg_mode="token-mean",
        entropy_coeff=0.0, use_kl_loss=False, kl_loss_coef=0.001, kl_loss_type="low_var_kl",
        moe_aux_loss_coef=0.0, moe_z_loss_coef=0.0, router_replay="none")
    assert a.budget is None  # padded rows
    assert a.samples_per_row(4) == 4 and a.samples_per_row(3) == 1  # 64 rows: groups of 4
    assert isinstance(a.entropy_coeff, float)  # the config's 0.0; an int 0 would be cast
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.clip_ratio = 0.3


def test_critic_and_score_specs_of_the_default_config():
    c = ppo_arith.get_config()
    critic = CriticSpec.of(c.critic)
    assert (critic.ppo_mini_batch_size, critic.ppo_micro_batch_size, critic.ppo_epochs,
            critic.cliprange_value, critic.loss_agg_mode) == (64, 64, 1, 0.5, "token-mean")
    assert CriticSpec.of(c.cost_critic, "cost_critic") == critic  # a copy of the critic's keys
    score = ScoreSpec.of(c.reward_model, "reward_model")
    assert score == ScoreSpec(path="", dtype="float32", use_remove_padding=False,
                              forward_max_token_len_per_gpu=0)
    assert score.budget is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        critic.ppo_epochs = 2


def test_the_rollout_spec_holds_the_default_configs_values():
    c = ppo_arith.get_config()
    r = RolloutSpec.of(c.rollout)
    assert r == RolloutSpec(
        n=1, response_length=10, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, mesh="",
        hybrid_engine=True, offload_optimizer=False, mode="static", decode_attention="auto",
        kv_layout="auto", slots=0, refill_every=8, min_slots=0, max_cache_len=0,
        multi_turn=MultiTurnSpec(enable=False, max_turns=4, tools="calculator",
                                 max_tool_response_len=64, tool_workers=8,
                                 max_parallel_calls=1))
    assert r.decode_mesh == ""  # no decode mesh: the actor decodes in its training layout
    assert RolloutSpec.of(r) is r
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.n = 4


def test_the_decode_mesh_follows_mesh_and_hybrid_engine():
    c = ppo_arith.get_config()
    c.rollout.mesh = "data=4,tensor=2"
    assert RolloutSpec.of(c.rollout).decode_mesh == "data=4,tensor=2"
    c.rollout.hybrid_engine = False  # the mesh is ignored
    assert RolloutSpec.of(c.rollout).decode_mesh == ""


def test_budgets_follow_the_packing_keys():
    c = ppo_arith.get_config()
    c.actor.use_remove_padding, c.actor.ppo_max_token_len_per_gpu = True, 96
    c.actor.ppo_micro_batch_size = 8
    a = ActorSpec.of(c.actor)
    assert a.budget == TokenBudget(96, 8)
    assert a.samples_per_row(4) == 1  # packed rows are never shared
    c.critic.use_remove_padding = True
    assert CriticSpec.of(c.critic).budget == TokenBudget(0, 64)  # 64 padded rows' worth
    c.cost_model.use_remove_padding, c.cost_model.forward_max_token_len_per_gpu = True, 40
    assert ScoreSpec.of(c.cost_model, "cost_model").budget == TokenBudget(40, 0)


def test_the_step_spec_holds_the_default_configs_values():
    c = ppo_arith.get_config()
    s = StepSpec.of(c)
    assert s.algo == AlgoSpec(
        adv_estimator="gae", gamma=1.0, lam=1.0, norm_adv_by_std_in_grpo=True,
        use_kl_in_reward=True, kl_penalty="kl",
        filter_groups=FilterGroupsSpec(enable=False, max_num_gen_batches=10,
                                       on_exhausted="fill"),
        overlong_buffer=OverlongSpec(enable=False, len=4, penalty_factor=1.0),
        rollout_correction=RolloutCorrectionSpec(
            rollout_is="", rollout_is_threshold=2.0, rollout_rs="", rollout_rs_threshold=0.0,
            rollout_rs_threshold_lower=0.0, rollout_token_veto_threshold=0.0,
            bypass_mode=False),
        distill=DistillSpec(coef=0.0, discount=0.0))
    assert not s.algo.rollout_correction.resolved.active
    assert s.rollout == RolloutSpec.of(c.rollout) and StepSpec.of(s) is s
    assert isinstance(s.algo.gamma, float)  # read as the field's type
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.algo.overlong_buffer.len = 8


def _keys(spec, prefix):
    """The dotted keys a spec reads, through its nested specs."""
    hints = typing.get_type_hints(spec)
    for f in dataclasses.fields(spec):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _keys(hints[f.name], f"{prefix}.{f.name}")
        else:
            yield f"{prefix}.{f.name}"


@pytest.mark.parametrize(("spec", "sections"), SPECS, ids=[s.__name__ for s, _ in SPECS])
def test_every_field_is_a_key_of_the_table(spec, sections):
    """A spec reads only keys the key table declares, so a config checked by hfjax.config has
    every one of them, with a valid value."""
    c = ppo_arith.get_config()
    for role in sections:
        for key in _keys(spec, role):
            assert key in TRAIN_KEYS, key
            value = c
            for part in key.split("."):
                value = value[part]
            assert TRAIN_KEYS[key](value) is None, key


def test_every_shipped_config_builds_the_specs():
    names = [m.name for m in pkgutil.iter_modules(configs.__path__)]
    assert "ppo_arith" in names and len(names) > 5
    for name in names:
        mod = importlib.import_module(f"configs.{name}")
        if not hasattr(mod, "get_config"):
            continue
        c = mod.get_config()
        for spec, sections in SPECS:
            for role in sections:
                assert isinstance(spec.of(c[role], role), spec), (name, role)


def test_a_wrong_type_is_refused_by_key():
    # A ConfigDict keeps its fields' types; plain mappings (and user code) need not.
    a = ppo_arith.get_config().actor.to_dict()
    a["ppo_micro_batch_size"] = "8"
    with pytest.raises(ValueError, match=r"actor\.ppo_micro_batch_size='8' needs an int; set "
                                         r"--config\.actor\.ppo_micro_batch_size"):
        ActorSpec.of(a)
    c = ppo_arith.get_config().cost_critic.to_dict()
    c["shuffle"] = 1  # an int is not a bool
    with pytest.raises(ValueError, match=r"cost_critic\.shuffle=1 needs True or False"):
        CriticSpec.of(c, "cost_critic")
    s = ppo_arith.get_config().reward_model.to_dict()
    s["forward_max_token_len_per_gpu"] = True  # a bool is not an int
    with pytest.raises(ValueError, match=r"reward_model\.forward_max_token_len_per_gpu=True "
                                         r"needs an int"):
        ScoreSpec.of(s, "reward_model")
    r = ppo_arith.get_config().rollout.to_dict()
    r["n"] = 4.0
    with pytest.raises(ValueError, match=r"rollout\.n=4\.0 needs an int; set "
                                         r"--config\.rollout\.n to one"):
        RolloutSpec.of(r)
    r = ppo_arith.get_config().rollout.to_dict()
    r["mesh"] = None  # no decode mesh is "", as the config checks ask too
    with pytest.raises(ValueError, match=r"rollout\.mesh=None needs a string"):
        RolloutSpec.of(r)


def test_a_missing_key_is_refused_by_name():
    a = ppo_arith.get_config().actor.to_dict()
    del a["logprob_chunk"]
    with pytest.raises(ValueError, match=r"actor section has no key logprob_chunk; derive the "
                                         r"config from configs/ppo_arith\.py"):
        ActorSpec.of(a)
    with pytest.raises(ValueError, match="the config has no critic section"):
        CriticSpec.of(None)
    # A partial rollout section takes no defaults: every key is the config's.
    with pytest.raises(ValueError, match=r"rollout section has no key n; derive the config "
                                         r"from configs/ppo_arith\.py, or set "
                                         r"--config\.rollout\.n"):
        RolloutSpec.of({"mode": "continuous", "slots": 4})
    r = ppo_arith.get_config().rollout.to_dict()
    del r["refill_every"]
    with pytest.raises(ValueError, match=r"rollout section has no key refill_every"):
        RolloutSpec.of(r)
    # Nested sections are named by their dotted path.
    r = ppo_arith.get_config().rollout.to_dict()
    del r["multi_turn"]["tool_workers"]
    with pytest.raises(ValueError, match=r"rollout\.multi_turn section has no key tool_workers; "
                                         r".*--config\.rollout\.multi_turn\.tool_workers"):
        RolloutSpec.of(r)
    a = ppo_arith.get_config().algo.to_dict()
    a["overlong_buffer"]["len"] = 4.5
    with pytest.raises(ValueError, match=r"algo\.overlong_buffer\.len=4\.5 needs an int"):
        AlgoSpec.of(a)


def test_workers_refuse_a_config_section():
    """Workers take specs: a ConfigDict is refused before anything is built."""
    c = ppo_arith.get_config()
    with pytest.raises(TypeError, match=r"ActorRollout: spec= is a ConfigDict, not the "
                                        r"ActorSpec it needs; build it once with "
                                        r"ActorSpec\.of\(cfg\.actor\)"):
        ActorRollout("actor", None, "fsdp=1", None, sampler=None, spec=c.actor,
                     rollout=RolloutSpec.of(c.rollout))
    with pytest.raises(TypeError, match=r"rollout= is a ConfigDict, not the RolloutSpec"):
        ActorRollout("actor", None, "fsdp=1", None, sampler=None,
                     spec=ActorSpec.of(c.actor), rollout=c.rollout)
    rollout = RolloutSpec.of(c.rollout)
    for cls in (Critic, CostCritic):
        with pytest.raises(TypeError, match=rf"{cls.__name__}: spec= is a ConfigDict, not "
                                            r"the CriticSpec it needs"):
            cls("critic", None, "fsdp=1", None, spec=c.critic, rollout=rollout)
        with pytest.raises(TypeError, match=rf"{cls.__name__}: rollout= is a ConfigDict, not "
                                            r"the RolloutSpec it needs; build it once with "
                                            r"RolloutSpec\.of\(cfg\.rollout\)"):
            cls("critic", None, "fsdp=1", None, spec=CriticSpec.of(c.critic), rollout=c.rollout)


def test_the_reference_scores_with_the_actors_specs():
    """The reference takes the actor's specs (one way for rollout.n to arrive) and refuses a
    config section as the actor does."""
    c = ppo_arith.get_config()
    with pytest.raises(TypeError, match=r"Reference: spec= is a ConfigDict, not the "
                                        r"ActorSpec it needs"):
        Reference("ref", None, "fsdp=1", None, spec=c.actor, rollout=RolloutSpec.of(c.rollout))
    with pytest.raises(TypeError, match=r"Reference: rollout= is a ConfigDict"):
        Reference("ref", None, "fsdp=1", None, spec=ActorSpec.of(c.actor), rollout=c.rollout)


def test_the_dataflow_refuses_a_config():
    """The advantage stage reads a StepSpec; a run's ConfigDict is refused, naming the fix."""
    c = ppo_arith.get_config()
    with pytest.raises(TypeError, match=r"compute_advantage: the settings argument is a "
                                        r"ConfigDict, not the StepSpec it needs; build it "
                                        r"once with hfjax\.algorithms\.spec\.StepSpec\.of"):
        dataflow.compute_advantage(None, c, 0.0)

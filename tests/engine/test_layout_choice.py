"""actor.rules=auto: the training rules follow from actor.mesh and rollout.mesh, the choice is
logged, and an impossible pair is still a clear LayoutError."""

import logging

import jax
import pytest
from flax import nnx
from support import rollout_spec

from hfjax.engine import hybrid
from hfjax.engine.layout_choice import actor_rules_and_engine
from hfjax.models import transformer
from hfjax.models.presets import get_preset
from hfjax.parallel.mesh import MeshSpec

SMALL = get_preset("tiny").replace(vocab_size=64, hidden_size=16, intermediate_size=32,
                                   num_heads=8, num_kv_heads=8, head_dim=4)


def rollout(mesh="", hybrid_engine=True):
    """The decode mesh a rollout section with these keys asks for."""
    return rollout_spec(mesh=mesh, hybrid_engine=hybrid_engine).decode_mesh


@pytest.fixture(scope="module")
def state():
    return nnx.state(transformer.abstract(SMALL))


def mesh(spec):
    return MeshSpec.parse(spec).build(jax.devices())


def test_without_a_decode_mesh_the_standard_rules(state):
    assert actor_rules_and_engine(mesh("fsdp=8"), "auto", rollout(), state) == ("train", None)
    off = rollout("data=4,tensor=2", hybrid_engine=False)
    assert actor_rules_and_engine(mesh("fsdp=8"), "auto", off, state) == ("train", None)


def test_train_rules_when_they_nest(state, caplog):
    with caplog.at_level(logging.INFO):
        rules, engine = actor_rules_and_engine(mesh("fsdp=4,tensor=2"), "auto",
                                               rollout("data=4,tensor=2"), state)
    assert rules == "train" and engine is not None
    assert any("actor.rules=auto: training rules 'train'" in r.getMessage()
               for r in caplog.records)


def test_nested_rules_when_only_they_nest(state, caplog):
    # FSDP alone keeps heads and mlp whole, which a tensor=2 decode splits: "train" cannot
    # nest, "nested_train" (fsdp splits what tensor splits) can.
    with pytest.raises(hybrid.LayoutError):
        actor_rules_and_engine(mesh("fsdp=8"), "train", rollout("data=4,tensor=2"), state)
    with caplog.at_level(logging.INFO):
        rules, engine = actor_rules_and_engine(mesh("fsdp=8"), "auto",
                                               rollout("data=4,tensor=2"), state)
    assert rules == "nested_train" and engine.micro_dp == 4
    line = next(r.getMessage() for r in caplog.records if "actor.rules=auto" in r.getMessage())
    assert "'nested_train'" in line and "train: " in line  # why train was passed over


def test_an_impossible_pair_is_still_a_clear_layout_error(state):
    # Replicas only (data=8) split nothing, so no decode tensor group can hold a shard.
    with pytest.raises(hybrid.LayoutError, match=r"rollout.mesh 'data=4,tensor=2' cannot hold "
                                                 r"the training shards.*train: .*nested_train: "):
        actor_rules_and_engine(mesh("data=8"), "auto", rollout("data=4,tensor=2"), state)
    # A decode mesh that cannot hold the model at all says so directly.
    smol = nnx.state(transformer.abstract(get_preset("smollm2-135m")))
    with pytest.raises(hybrid.LayoutError, match="cannot hold the model.*'heads'=9"):
        actor_rules_and_engine(mesh("fsdp=8"), "auto", rollout("data=4,tensor=2"), smol)


def test_explicit_rules_are_kept(state):
    rules, engine = actor_rules_and_engine(mesh("fsdp=8"), "nested_train",
                                           rollout("data=4,tensor=2"), state)
    assert rules == "nested_train" and engine is not None
    rules, engine = actor_rules_and_engine(mesh("fsdp=8"), "train", rollout(), state)
    assert rules == "train" and engine is None

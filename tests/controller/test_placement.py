"""Placement modes and explicit mappings, resolved to resource pools on 8 devices."""

import jax
import pytest
from ml_collections import ConfigDict

from hfjax.controller.placement import Placement, build_placement, resolve_placement

PPO = ("actor", "ref", "critic")
GRPO = ("actor", "ref")
FULL = ("actor", "ref", "critic", "reward")


def ids(pool):
    return pool.device_ids


def test_colocate_puts_every_role_on_one_global_pool():
    pools = resolve_placement("colocate", PPO)
    assert set(pools) == set(PPO)
    assert all(pools[r] is pools["actor"] for r in PPO)
    assert pools["actor"].name == "global"
    assert ids(pools["actor"]) == tuple(range(8))


def test_split_halves_devices_between_generation_and_scoring_sides():
    pools = resolve_placement("split", ("actor", "ref", "critic", "reward"))
    assert pools["actor"].name == pools["ref"].name == "actor_pool"
    assert pools["critic"].name == pools["reward"].name == "critic_pool"
    assert ids(pools["actor"]) == (0, 1, 2, 3)
    assert ids(pools["critic"]) == (4, 5, 6, 7)
    assert pools["critic"] is pools["reward"]


def test_split_without_scoring_models_uses_one_pool():
    pools = resolve_placement("split", GRPO)
    assert {p.name for p in pools.values()} == {"actor_pool"}
    assert pools["actor"].size == 8


def test_standalone_ppo_gives_each_model_two_devices():
    pools = resolve_placement("standalone", ("actor", "ref", "critic", "reward"))
    names = {r: p.name for r, p in pools.items()}
    assert names == {
        "actor": "actor_pool",
        "ref": "ref_pool",
        "critic": "critic_pool",
        "reward": "reward_pool",
    }
    assert [ids(pools[r]) for r in ("actor", "ref", "critic", "reward")] == [
        (0, 1),
        (2, 3),
        (4, 5),
        (6, 7),
    ]


def test_standalone_gives_remainder_to_actor():
    # GRPO: actor and ref only -> 4 + 4; PPO's 4 models on 7 devices -> actor gets 4.
    pools = resolve_placement("standalone", GRPO)
    assert (pools["actor"].size, pools["ref"].size) == (4, 4)
    pools = resolve_placement("standalone", FULL, jax.devices()[:7])
    sizes = {r: p.size for r, p in pools.items()}
    assert sizes == {"actor": 4, "ref": 1, "critic": 1, "reward": 1}
    all_ids = [i for r in ("actor", "ref", "critic", "reward") for i in ids(pools[r])]
    assert sorted(all_ids) == list(range(7))


def test_standalone_needs_a_device_per_model():
    with pytest.raises(ValueError, match=r"placement 'standalone' needs 4 pools .* only 3 devices"):
        resolve_placement("standalone", FULL, jax.devices()[:3])


def test_explicit_mapping_with_sizes():
    mapping = {
        "gen": {"size": 6, "roles": ["actor", "ref"]},
        "score": {"size": 2, "roles": ["critic"]},
    }
    pools = resolve_placement(mapping, PPO)
    assert ids(pools["actor"]) == (0, 1, 2, 3, 4, 5)
    assert ids(pools["critic"]) == (6, 7)
    assert pools["ref"] is pools["actor"]


def test_explicit_mapping_from_config_dict_and_inactive_roles_ignored():
    cfg = ConfigDict(
        {
            "a": {"size": 4, "roles": ["actor", "ref"]},
            "b": {"size": 4, "roles": ["critic", "reward"]},
        }
    )
    pools = resolve_placement(cfg, GRPO)
    assert set(pools) == set(GRPO)
    assert pools["actor"].name == "a"


def test_explicit_mapping_with_device_ids():
    mapping = {
        "gen": {"devices": [4, 5, 6, 7], "roles": ["actor", "rollout"]},
        "ref": {"devices": [0, 1], "roles": ["ref"]},
    }
    pools = resolve_placement(mapping, GRPO)
    assert ids(pools["actor"]) == (4, 5, 6, 7)
    assert ids(pools["ref"]) == (0, 1)
    # "rollout" there is the actor generating: an alias, dropped from the pool's roles.
    assert build_placement(mapping, GRPO, 8).pools["gen"].roles == ("actor",)


def test_rollout_without_the_actor_is_refused():
    mapping = {"gen": {"size": 4, "roles": ["rollout", "ref"]},
               "train": {"size": 4, "roles": ["actor"]}}
    with pytest.raises(ValueError, match=r"placement pool 'gen': 'rollout' is not a role of its "
                                         r"own: the actor generates .*put 'actor' in this pool "
                                         r"or drop 'rollout'"):
        resolve_placement(mapping, GRPO)
    with pytest.raises(ValueError, match="unknown role 'rollout'"):
        resolve_placement("colocate", ("actor", "rollout"))


@pytest.mark.parametrize(
    "mapping, roles, match",
    [
        (
            {"gen": {"size": 4, "roles": ["actor", "ref"]}},
            PPO,
            r"role 'critic' has no pool in placement mapping\{gen=4:\[actor,ref\]\}; "
            r"add it to a pool",
        ),
        (
            {"a": {"size": 4, "roles": ["actor", "ref"]}, "b": {"size": 4, "roles": ["ref"]}},
            ("actor", "ref"),
            r"role 'ref' is on two pools, 'a' and 'b'",
        ),
        (
            {"a": {"size": 6, "roles": ["actor"]}, "b": {"size": 4, "roles": ["ref"]}},
            ("actor", "ref"),
            r"needs 10 devices, only 8 are available",
        ),
        (
            {
                "a": {"devices": [0, 1, 2], "roles": ["actor"]},
                "b": {"devices": [2, 3], "roles": ["ref"]},
            },
            ("actor", "ref"),
            r"pools 'a' and 'b' overlap on device 2",
        ),
        (
            {"a": {"devices": [0, 9], "roles": ["actor"]}},
            ("actor",),
            r"device ids \[9\] don't exist",
        ),
        (
            {"a": {"size": 4, "devices": [0], "roles": ["actor"]}},
            ("actor",),
            r"give exactly one of 'size'",
        ),
        ({"a": {"size": 4, "roles": ["policy"]}}, ("actor",), r"unknown role 'policy'"),
        ({"a": {"size": 4, "roles": "actor"}}, ("actor",), r"'roles' must be a non-empty list"),
        ({"a": {"size": 0, "roles": ["actor"]}}, ("actor",), r"size must be a positive int"),
        (
            {"a": {"size": 4, "roles": ["actor"], "mesh": "x"}},
            ("actor",),
            r"unknown keys \['mesh'\]",
        ),
        ({"a": 4}, ("actor",), r"expected \{'size': n, 'roles'"),
    ],
)
def test_explicit_mapping_errors(mapping, roles, match):
    with pytest.raises(ValueError, match=match):
        resolve_placement(mapping, roles)


def test_mode_errors():
    with pytest.raises(ValueError, match=r"unknown placement mode 'hybrid'; use one of colocate"):
        resolve_placement("hybrid", PPO)
    with pytest.raises(ValueError, match=r"active roles: unknown role 'policy'"):
        resolve_placement("colocate", ("policy",))
    with pytest.raises(ValueError, match=r"no roles given"):
        resolve_placement("colocate", ())
    with pytest.raises(TypeError, match="placement must be one of"):
        resolve_placement(3, PPO)


def test_placement_object_exposes_role_pool_and_description():
    placement = build_placement("split", PPO, 8)
    assert isinstance(placement, Placement)
    assert placement.role_pool == {
        "actor": "actor_pool",
        "ref": "actor_pool",
        "critic": "critic_pool",
    }
    assert placement.describe() == "split{actor_pool=4:[actor,ref], critic_pool=4:[critic]}"


def test_placement_mapping_from_a_flag_string():
    from hfjax.controller.placement import parse_mapping, resolve_placement

    text = "gen=6:actor+ref;score=2:critic+reward"
    assert parse_mapping(text) == {
        "gen": {"size": 6, "roles": ["actor", "ref"]},
        "score": {"size": 2, "roles": ["critic", "reward"]},
    }
    pools = resolve_placement(text, ["actor", "ref", "critic", "reward"])
    assert pools["actor"].size == 6 and pools["critic"].size == 2
    assert pools["actor"] is pools["ref"]
    with pytest.raises(ValueError, match="write pool=size:role"):
        parse_mapping("gen=four:actor")


def test_registered_roles_place_like_the_built_in_ones():
    from hfjax.controller.placement import known_roles, place_role

    place_role("test_scorer", "score")
    place_role("test_scorer", "score")  # registering again with the same side is a no-op
    assert "test_scorer" in known_roles()
    roles = ("actor", "ref", "critic", "test_scorer")
    split = Placement.from_mode("split", roles, 8)
    assert split.role_pool["test_scorer"] == split.role_pool["critic"] == "critic_pool"
    standalone = Placement.from_mode("standalone", roles, 8)
    assert standalone.role_pool["test_scorer"] == "test_scorer_pool"
    assert len(standalone.pools) == 4
    with pytest.raises(ValueError, match=r"already registered on the 'score' side"):
        place_role("test_scorer", "generate")
    with pytest.raises(ValueError, match=r"must be a Python identifier"):
        place_role("my-role")
    with pytest.raises(ValueError, match=r"unknown role 'tset_scorer'.*register_role"):
        Placement.from_mode("colocate", ("actor", "tset_scorer"), 8)

"""Placement mappings reach the run from both places a user writes them: the command line
(`--config.placement="gen=4:actor+ref;score=4:critic+reward"`) and a config derived from
configs/ppo_arith.py that assigns a {pool: {size, roles}} mapping. Both are parsed by the same
ml_collections flag the launcher uses, pass the config checks and give the same pools; one PPO
step under the command-line spelling runs in tests/run/test_rl_loop.py (PLACEMENTS)."""

import os

from absl import flags
from ml_collections import config_flags

from hfjax.config import check_config, placement_of, validate_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAPPING = "gen=4:actor+ref;score=4:critic+reward"
DERIVED = '''
from configs import ppo_arith


def get_config():
    c = ppo_arith.get_config()
    c.placement = {"gen": {"size": 4, "roles": ["actor", "ref"]},
                   "score": {"size": 4, "roles": ["critic", "reward"]}}
    return c
'''


def _parse(*args):
    """The config the launcher would get for these command-line arguments."""
    argv = ["launch.train", *args]
    values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, flag_values=values, sys_argv=argv)
    values(argv)
    return values.config


def _pools(cfg):
    _, pools = validate_config(cfg)
    return {role: sorted(d.id for d in pool.devices) for role, pool in pools.items()}


def test_mapping_on_the_command_line_and_in_a_derived_config_give_the_same_pools(tmp_path):
    config = os.path.join(ROOT, "configs", "ppo_arith.py")
    cli = _parse(f"--config={config}", f"--config.placement={MAPPING}")
    assert cli.placement == MAPPING
    derived_file = tmp_path / "derived.py"
    derived_file.write_text(DERIVED)
    derived = _parse(f"--config={derived_file}")
    assert placement_of(derived) == {
        "gen": {"size": 4, "roles": ["actor", "ref"]},
        "score": {"size": 4, "roles": ["critic", "reward"]}}
    want = {"actor": [0, 1, 2, 3], "ref": [0, 1, 2, 3], "critic": [4, 5, 6, 7],
            "reward": [4, 5, 6, 7]}
    for cfg in (cli, derived):
        cfg.actor.ppo_micro_batch_size = cfg.critic.ppo_micro_batch_size = 64
        assert _pools(cfg) == want


def test_a_mode_overrides_a_derived_mapping_and_back(tmp_path):
    derived_file = tmp_path / "derived.py"
    derived_file.write_text(DERIVED)
    cfg = _parse(f"--config={derived_file}", "--config.placement=split")
    assert cfg.placement == "split"
    check_config(cfg)
    cfg = _parse(f"--config={derived_file}", f"--config.placement={MAPPING}")
    assert cfg.placement == MAPPING
    check_config(cfg)

"""Every setting of every entry point, checked in one pass before anything is built or written.

A train config's keys each have one row in `TRAIN_KEYS` (keys.py: what a valid value is); the
rules that tie keys together are the functions in `TRAIN_RULES` (rules.py). The flags of the
other entry points have their rows in `FLAG_KEYS[entry]` and their cross-flag rules in
`FLAG_RULES[entry]` (flags.py). A key a spec reads is declared once, by the spec's field
with its check (`hfjax.settings.key`); keys.py gathers those rows with its own (the keys no spec
reads). The value types are in `hfjax.settings.values`, the checks that read a registry or the
file system in validators.py (and `hfjax.settings.checks`, those of spec keys).

- `check_config(cfg)`: a train config, every key and rule, with no devices and no files
  written (a config key missing from `TRAIN_KEYS`, e.g. a typo in a derived config, is an
  error too: add its row to keys.py when adding a key);
- `check_flags(entry, values)`: one entry point's flags;
- `register_keys(rows)`: rows for the config sections of a user algorithm's own roles (called
  when its module is imported, which the `algorithm` key's check does first);
- `validate_config(cfg)`: `check_config` plus what needs the devices (placement, meshes, batch
  splits over the data-parallel size); it returns the Algorithm and each role's pool.

Each raises `ConfigError` (a ValueError) with one line naming the key, its value, what a valid
value is and how to set it. The registries are imported inside the checks that need them;
the spec modules whose fields declare keys are imported with the key table (they load JAX).
`model_source.py` (where a run's model and tokenizer come from) is imported on its own: it
loads JAX.
"""

from hfjax.config.check import check_config, check_flags, config_items, validate_config
from hfjax.config.flags import COMMON_FLAG_KEYS, FLAG_KEYS, FLAG_RULES, flag_checks
from hfjax.config.keys import TRAIN_KEYS, register_keys
from hfjax.config.rules import MODEL_ROLES, TRAIN_RULES, active_roles, placement_of, run_roles
from hfjax.settings.values import Bool, Check, Choice, ConfigError, Float, Int, Text

__all__ = [
    "COMMON_FLAG_KEYS", "FLAG_KEYS", "FLAG_RULES", "MODEL_ROLES", "TRAIN_KEYS", "TRAIN_RULES",
    "Bool", "Check", "Choice", "ConfigError", "Float", "Int", "Text", "active_roles",
    "check_config", "check_flags", "config_items", "flag_checks", "placement_of",
    "register_keys", "run_roles", "validate_config",
]

"""What a valid config value is, at the bottom of the package graph, so that each spec field
declares its key's check where the field is declared (`key`) and the config's key table
(`hfjax.config.keys.TRAIN_KEYS`) gathers them (`spec_rows`) instead of repeating them.

- values.py: the value types (Int, Float, Bool, Choice, Text, Check) and `ConfigError`;
- checks.py: the checks of spec keys that read a registry or the file system;
- fields.py: `key(check)`, a spec field that is a config key, and `spec_rows`.
"""

from hfjax.settings.fields import key, spec_rows
from hfjax.settings.values import Bool, Check, Choice, ConfigError, Float, Int, Text

__all__ = ["Bool", "Check", "Choice", "ConfigError", "Float", "Int", "Text", "key",
           "spec_rows"]

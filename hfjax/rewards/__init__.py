"""Rule rewards keyed by data_source (`registry`), the built-in ones (`math`, `reasoning_gym`),
custom reward files (`custom`) and the processes that score (`pool`, `scorer`).

Importing the package registers the built-in rewards: they import the registry and register
themselves; the registry imports none of them.
"""

from hfjax.rewards import math, reasoning_gym  # noqa: F401  (they register on import)

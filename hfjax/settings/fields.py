"""One declaration per config key that a spec reads: the spec's field, whose metadata holds the
key's check (`key`); `spec_rows` turns a spec class at a config section into key-table rows."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable
from typing import Any

CHECK = "hfjax.settings.check"

Row = Callable[[Any], "str | None"]


def key(check: Row, *, default: Any = dataclasses.MISSING) -> Any:
    """A spec field that is the config key of its name: `check` is what a valid value is
    (its row in the key table, `hfjax.config.keys.TRAIN_KEYS`). A spec has no defaults of its
    own (`hfjax.engine.spec`); `default` is for building one in code only."""
    return dataclasses.field(default=default, metadata={CHECK: check})


def spec_rows(cls: type, section: str) -> dict[str, Row]:
    """The key-table rows of spec `cls` read from config section `section`: one per field,
    `section.field`, through nested specs (`rollout.multi_turn.*`). A field declared without
    `key` is refused: every key a spec reads must say what a valid value is."""
    hints = typing.get_type_hints(cls)
    rows: dict[str, Row] = {}
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            rows.update(spec_rows(kind, f"{section}.{f.name}"))
        elif CHECK in f.metadata:
            rows[f"{section}.{f.name}"] = f.metadata[CHECK]
        else:
            raise TypeError(f"{cls.__name__}.{f.name} declares no check; declare the field "
                            "with hfjax.settings.key(check)")
    return rows

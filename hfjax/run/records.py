"""A run's metric record: what every sink takes ({name: Python float} for one step) and its
strict-JSON line in `metrics.jsonl`.

The line is strict JSON (RFC 8259), so any JSON reader takes it: a NaN or infinite metric is
written as the string "NaN", "Infinity" or "-Infinity" (Python's own spellings, quoted), and
`read_jsonl` turns those strings back into floats. The sinks that write records
(`hfjax.run.metrics`, `hfjax.run.trackers`) both build on this module.
"""

from __future__ import annotations

import json
import math
import numbers
import os
from collections.abc import Mapping
from typing import Any

from absl import logging


def scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """`metrics` as {name: Python float}; a TypeError names a value that is not a real number."""
    out = {}
    for k, v in metrics.items():
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"metric {k!r} is {type(v).__name__}; sinks take Python floats")
        out[k] = float(v)
    return out


# How a non-finite float is written (strict JSON has no NaN or Infinity), and read back.
_NONFINITE_TEXT = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _strict(v):
    if isinstance(v, float) and not math.isfinite(v):
        return "NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity")
    return v


def _from_strict(v):
    return _NONFINITE_TEXT.get(v, v) if isinstance(v, str) else v


def encode_record(record: Mapping[str, Any]) -> str:
    """One strict-JSON line for a record: keys sorted, floats written with repr (they read back
    bit for bit), non-finite floats as the strings "NaN", "Infinity", "-Infinity"."""
    return json.dumps({k: _strict(v) for k, v in record.items()}, sort_keys=True, allow_nan=False)


def read_jsonl(path: str) -> list[dict]:
    """The records of a metrics JSONL file in file order (non-finite values back as floats); a
    torn last line (a killed write) is skipped with a warning. A damaged line elsewhere raises
    ValueError saying how to recover."""
    if not os.path.exists(path):
        return []
    records = []
    with open(path) as f:
        lines = f.read().split("\n")
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError("not a record with a step")
        except ValueError as err:
            if i >= len(lines) - 2:
                logging.warning("%s: ignoring a torn last line (%d chars)", path, len(line))
                continue
            raise ValueError(
                f"{path}: line {i + 1} is damaged ({err.__class__.__name__}: {line[:60]!r}); "
                f"the checkpoints are not affected: delete or repair that line, or move "
                f"{path} aside (the resumed run then starts a new file), and rerun") from None
        records.append({k: _from_strict(v) for k, v in record.items()})
    return records


def format_record(step: int, metrics: Mapping[str, float]) -> str:
    """One JSONL line for a step (see `encode_record`)."""
    return encode_record({"step": int(step), **scalars(metrics)})

"""The collectives of an optimized HLO module, read from its text (`compiled.as_text()`): which
op, which result shapes, how many devices per group. Where work runs is shown this way, not by
equal numbers (tests/models/test_sequence_parallel_hlo.py, bench/sequence_parallel.py)."""

from __future__ import annotations

import dataclasses
import math
import re

_COLLECTIVE = re.compile(r"= (\(.*?\)|\S+) (all-gather|all-reduce|reduce-scatter|all-to-all|"
                         r"collective-permute)(?:-start)?\((.*)$")
_SHAPE = re.compile(r"\b(pred|s32|u32|s8|u8|bf16|f16|f32|f64)\[([\d,]*)\]")
BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4,
         "f64": 8}


@dataclasses.dataclass(frozen=True)
class Collective:
    op: str
    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    group: int  # devices per replica group (1: a no-op)
    line: str

    @property
    def nbytes(self) -> int:
        return sum(BYTES[dt] * math.prod(dims) for dt, dims in self.shapes)


def _group_size(rest: str) -> int:
    m = re.search(r"replica_groups=\{(\{[\d,]*\})", rest)
    if m:
        return len(m.group(1).strip("{}").split(","))
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]", rest)
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", rest)
    if m:
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", m.group(1)))
        return math.prod(int(sizes[a]) for a in re.findall(r"'(\w+)'", m.group(2)))
    m = re.search(r"source_target_pairs=\{([^}]*\})*\}", rest)
    return 2 if m else 0  # collective-permute: pairs; 0: groups not stated (all devices)


def collectives(text: str) -> list[Collective]:
    """Every collective of an optimized HLO module: its op, result shapes and group size."""
    out = []
    for line in text.splitlines():
        m = _COLLECTIVE.search(line)
        if m:
            shapes = tuple((dt, tuple(int(d) for d in dims.split(",") if d))
                           for dt, dims in _SHAPE.findall(m.group(1)))
            out.append(Collective(m.group(2), shapes, _group_size(m.group(3)), line.strip()))
    return out

"""Which XLA programs a run compiles, for which stage and shapes, and how long each took.

JAX reports every backend compile (`/jax/core/compile/backend_compile_duration`, with the
program's name; a program read back from the persistent compilation cache reports its read
time) and every trace to a jaxpr through `jax.monitoring`; `CompileLog` listens to both and
files each event under the stage running at the time (`stage(name)`, which
`WorkerGroups.run` opens around every stage of a step). The shapes come from JAX's own
"Compiling <name> with global shapes and types ..." debug line: only the integer and boolean
arguments are kept (token ids, masks, positions: what sets a program's batch and width), not the
weights.

    log = compile_log.install()
    ...                       # compile things
    records = log.take()      # everything compiled since the last take
    metrics |= compile_log.metrics(records)

Library code: nothing is printed; `summary(records)` gives the lines a caller logs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging as py_logging
import re
import threading
from collections.abc import Iterator

_BACKEND_EVENT = "/jax/core/compile/backend_compile_duration"
_TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
_LOWER_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
# The logger JAX writes its "Compiling ... with global shapes" line to (at DEBUG).
_SHAPES_LOGGER = "jax._src.interpreters.pxla"
_KEPT_DTYPES = re.compile(r"^(int|uint|bool)")


@dataclasses.dataclass
class Compile:
    """One backend compile: the program's name, the stage it ran in ("" outside any), its
    integer/boolean argument shapes, and its seconds (compile, or reading it back from the
    persistent cache)."""

    name: str
    stage: str
    shapes: str
    seconds: float


@dataclasses.dataclass
class Records:
    """What `CompileLog.take` returns: the compiles, and the seconds spent tracing and lowering
    (Python work before each compile, also paid again for a cached program)."""

    compiles: list[Compile] = dataclasses.field(default_factory=list)
    trace_s: float = 0.0

    @property
    def seconds(self) -> float:
        """All of it: backend compiles (or cache reads) plus tracing and lowering."""
        return sum(c.seconds for c in self.compiles) + self.trace_s


class CompileLog:
    """Collects compile events from the moment it is installed (see the module docstring)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._stage = threading.local()
        self._records = Records()
        self._shapes: dict[str, str] = {}

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Files the compiles inside the block under `name` (nested blocks: the innermost)."""
        prev = getattr(self._stage, "name", "")
        self._stage.name = name
        try:
            yield
        finally:
            self._stage.name = prev

    def take(self) -> Records:
        """The records since the previous take (or installation), and starts afresh."""
        with self._lock:
            out, self._records = self._records, Records()
        return out

    # -- listeners -------------------------------------------------------------------------------

    def _on_duration(self, event: str, duration: float, **kwargs) -> None:
        if event == _BACKEND_EVENT:
            name = str(kwargs.get("fun_name", "?"))
            rec = Compile(name, getattr(self._stage, "name", ""),
                          self._shapes.pop(name, ""), float(duration))
            with self._lock:
                self._records.compiles.append(rec)
        elif event in (_TRACE_EVENT, _LOWER_EVENT):
            with self._lock:
                self._records.trace_s += float(duration)

    def _on_shapes(self, record: py_logging.LogRecord) -> None:
        args = record.args if isinstance(record.args, tuple) else ()
        if len(args) >= 2 and str(record.msg).startswith("Compiling %s with global shapes"):
            self._shapes[str(args[0])] = _int_shapes(args[1])


class _ShapesFilter(py_logging.Filter):
    """On JAX's lowering logger, set to DEBUG: hands the "Compiling ... with global shapes"
    records to the log and lets through only what the logger's previous level would have."""

    def __init__(self, log: CompileLog, level: int):
        super().__init__()
        self.log, self.level = log, level

    def filter(self, record: py_logging.LogRecord) -> bool:
        self.log._on_shapes(record)
        return record.levelno >= self.level


_INSTALLED: CompileLog | None = None
_INSTALL_LOCK = threading.Lock()


def install() -> CompileLog:
    """The process's compile log, listening from its first call on (listeners cannot be
    removed from jax.monitoring, so there is one per process)."""
    global _INSTALLED
    with _INSTALL_LOCK:
        if _INSTALLED is None:
            from jax import monitoring

            log = CompileLog()
            monitoring.register_event_duration_secs_listener(log._on_duration)
            logger = py_logging.getLogger(_SHAPES_LOGGER)
            logger.addFilter(_ShapesFilter(log, logger.getEffectiveLevel()))
            logger.setLevel(py_logging.DEBUG)
            _INSTALLED = log
    return _INSTALLED


def stage(name: str):
    """`CompileLog.stage` of the installed log, or a no-op block when none is installed."""
    return _INSTALLED.stage(name) if _INSTALLED is not None else contextlib.nullcontext()


def _int_shapes(avals) -> str:
    """'int32[32,384] bool[32,384]': the distinct integer and boolean argument types, in
    order."""
    seen: list[str] = []
    for a in avals if isinstance(avals, (list, tuple)) else ():
        text = str(a)
        if _KEPT_DTYPES.match(text) and text not in seen:
            seen.append(text)
    return " ".join(seen)


def metrics(records: Records) -> dict[str, float]:
    """`timing_s/compile` (backend compile seconds, all programs), `timing_s/trace` (tracing
    and lowering), `compile/programs` (how many were compiled) and one
    `compile_s/<stage>/<program>` per stage and program name (seconds, summed over its
    shapes)."""
    out = {"timing_s/compile": sum(c.seconds for c in records.compiles),
           "timing_s/trace": records.trace_s,
           "compile/programs": float(len(records.compiles))}
    for c in records.compiles:
        key = f"compile_s/{c.stage or 'other'}/{c.name}"
        out[key] = out.get(key, 0.0) + c.seconds
    return out


def summary(records: Records) -> list[str]:
    """One line per compiled program, slowest first: seconds, stage, name and shapes."""
    rows = sorted(records.compiles, key=lambda c: -c.seconds)
    return [f"{c.seconds:7.2f} s  {c.stage or 'other':<14} {c.name}  {c.shapes}" for c in rows]

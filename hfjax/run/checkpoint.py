"""Run checkpoints on an Orbax `CheckpointManager`.

A checkpoint is one step directory `<root>/<step>/` holding
- one array item per model state, e.g. `actor_params`, `actor_opt_state`, `ref_params`,
  `critic_params`, `critic_opt_state`: each a flat `{leaf name: jax.Array}` dict, where the leaf
  name is the leaf's pytree path (`model.layers.q_proj.value`, `1.0.mu.model.embed_tokens.value`),
  so any pytree (an `nnx.State`, an optax state) saves without Orbax knowing its node types;
- `trainer`: JSON host state (step, data order and RNG, KL controller, …) plus the shape, dtype
  and a fingerprint of every saved array;
- `config`: the run's resolved config as JSON.

Saves are asynchronous: `save` returns once the arrays are copied off the devices, and Orbax
writes under `<step>.orbax-checkpoint-tmp*` and renames the directory into place when every item
is complete. A save killed half way never becomes a step, and the next manager removes its
temporary directory.

Restores read onto the shardings of the *current* run's arrays (Orbax reshards), so a checkpoint
saved on one mesh or placement restores on another. A checkpoint that fails to read, or whose
arrays do not match their saved fingerprints (a truncated, deleted or overwritten file), is
corrupt: `restore_latest` warns, naming it, and falls back to the step before. A checkpoint whose
structure does not match the run (another model size) is not corrupt but a mistake, and raises.
"""

from __future__ import annotations

import dataclasses
import json
import logging as logging_std
import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from jax.experimental import multihost_utils

from hfjax.config.run_dir import TRAINER_ITEM
from hfjax.parallel.transfer import host_values
from hfjax.run import ckpt_shards

CONFIG_ITEM = "config"
RESERVED = (TRAINER_ITEM, CONFIG_ITEM)
ARRAYS = "arrays"


class CheckpointCorrupt(RuntimeError):
    """A checkpoint that cannot be read back as it was written."""


class CheckpointMismatch(ValueError):
    """A readable checkpoint whose arrays do not fit the current run's structure."""


class NonFiniteCheckpoint(ValueError):
    """A save refused because an array or the trainer state holds NaN or infinity."""


# -- pytrees as flat named dicts -------------------------------------------------------------


def _key_str(k) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def named_leaves(tree: Any) -> dict[str, Any]:
    """{dotted pytree path: leaf} in flatten order."""
    out: dict[str, Any] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = ".".join(_key_str(k) for k in path) or "value"
        if name in out:
            raise ValueError(f"two leaves share the checkpoint name {name!r}")
        out[name] = leaf
    return out


def _abstract(x) -> jax.ShapeDtypeStruct:
    sharding = getattr(x, "sharding", None)
    if sharding is None:
        raise ValueError(f"restore target leaf {x!r} has no sharding")
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


# -- fingerprints ----------------------------------------------------------------------------


def _fingerprint(x: jax.Array) -> jax.Array:
    # A position-weighted sum of the raw bits modulo 2**32: integer addition is associative,
    # so the value is the same whatever the sharding or reduction order, and a changed, zeroed or
    # moved element changes it.
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    size = x.dtype.itemsize
    if size == 8:
        bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    else:
        uint = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[size]
        bits = jax.lax.bitcast_convert_type(x, uint).astype(jnp.uint32)
    bits = bits.reshape(-1)
    weights = jnp.arange(bits.size, dtype=jnp.uint32) * jnp.uint32(2654435761) + jnp.uint32(1)
    return jnp.sum(bits * weights, dtype=jnp.uint32)


@jax.jit
def _fingerprints(arrays: dict[str, jax.Array]) -> dict[str, jax.Array]:
    return {k: _fingerprint(v) for k, v in arrays.items()}


@jax.jit
def _finite(arrays: dict[str, jax.Array]) -> dict[str, jax.Array]:
    return {k: jnp.all(jnp.isfinite(v)) if jnp.issubdtype(v.dtype, jnp.inexact)
            else jnp.bool_(True) for k, v in arrays.items()}


def _describe(item: str, arrays: Mapping[str, jax.Array]) -> dict[str, dict]:
    """Shape, dtype and fingerprint of each array (one small fetch, on every process also
    where the arrays sit on another process's devices); NonFiniteCheckpoint when one holds
    NaN or infinity, so that no checkpoint is ever written with one."""
    arrays = dict(arrays)
    fp, finite = _fingerprints(arrays), _finite(arrays)
    got = host_values({**{f"fp/{k}": v for k, v in fp.items()},
                       **{f"ok/{k}": v for k, v in finite.items()}})
    bad = [k for k in arrays if not got[f"ok/{k}"]]
    if bad:
        more = f" (and {len(bad) - 1} more arrays)" if len(bad) > 1 else ""
        raise NonFiniteCheckpoint(f"{item}/{bad[0]}{more} holds NaN or infinity; refusing to "
                                  "write a checkpoint of it")
    return {k: {"shape": list(v.shape), "dtype": np.dtype(v.dtype).name,
                "fingerprint": int(got[f"fp/{k}"])} for k, v in arrays.items()}


def fingerprints(arrays: Mapping[str, jax.Array]) -> dict[str, int]:
    """{name: 32-bit fingerprint} of a named array dict (one small deliberate host fetch)."""
    return {k: int(v) for k, v in host_values(_fingerprints(dict(arrays))).items()}


# -- locating checkpoints --------------------------------------------------------------------


def locate(path: str) -> tuple[str, int | None]:
    """(checkpoint root, step or None for the latest) for a run's out_dir, a checkpoint root or
    one step directory."""
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no checkpoint directory at {path}")
    if os.path.isdir(os.path.join(path, "checkpoints")):
        return os.path.join(path, "checkpoints"), None
    base = os.path.basename(path)
    if base.isdigit() and os.path.isdir(os.path.join(path, TRAINER_ITEM)):
        return os.path.dirname(path), int(base)
    return path, None


Targets = Mapping[str, Any] | Callable[[dict], Mapping[str, Any]]


@dataclasses.dataclass
class Restored:
    """One checkpoint read back: its step, array items (in the targets' pytree structures), the
    trainer state and the saved config."""

    step: int
    items: dict[str, Any]
    state: dict
    config: dict
    skipped: list[str] = dataclasses.field(default_factory=list)


class RunCheckpointer:
    """Saves and restores a run's checkpoints under `directory` (see the module docstring)."""

    def __init__(self, directory: str, *, max_to_keep: int | None = 2, async_save: bool = True,
                 read_only: bool = False):
        self.directory = os.path.abspath(directory)
        if read_only and not os.path.isdir(self.directory):
            raise FileNotFoundError(f"no checkpoint directory at {self.directory}")
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            enable_async_checkpointing=async_save,
            create=not read_only,
            read_only=read_only,
            cleanup_tmp_directories=not read_only,
        )
        self._mgr = ocp.CheckpointManager(self.directory, options=options)
        self.last_saved: int | None = None

    # -- saving --------------------------------------------------------------------------------

    def save(self, step: int, items: Mapping[str, Any], state: Mapping[str, Any],
             config: Mapping[str, Any]) -> None:
        """Starts an async save of array items (pytrees), JSON trainer state and config."""
        bad = [k for k in items if k in RESERVED]
        if bad:
            raise ValueError(f"array item names {bad} are reserved for the checkpoint's JSON")
        arrays = {name: named_leaves(tree) for name, tree in items.items()}
        state = dict(state)
        state[ARRAYS] = {name: _describe(name, a) for name, a in arrays.items()}
        try:  # strict JSON: a NaN in the host state (e.g. a KL coefficient) is refused too
            json.dumps([state, dict(config)], allow_nan=False)
        except ValueError as err:
            raise NonFiniteCheckpoint(f"the trainer state or config of step {step} holds NaN "
                                      f"or infinity ({err}); refusing to write it") from None
        args = {}
        for name, leaves in arrays.items():
            # Arrays on the devices of some processes only go to the item's per-process part
            # (hfjax.run.ckpt_shards); the others to Orbax's collective save.
            whole = {k: v for k, v in leaves.items() if ckpt_shards.spans_all_processes(v)}
            part = {k: v for k, v in leaves.items() if k not in whole}
            if whole:
                args[name] = ocp.args.StandardSave(whole)
            if part:
                args[name + ckpt_shards.SUFFIX] = ckpt_shards.PerProcessSave(
                    ckpt_shards.own_shards(part))
                for k in part:
                    state[ARRAYS][name][k]["per_process"] = True
        args[TRAINER_ITEM] = ocp.args.JsonSave(state)
        args[CONFIG_ITEM] = ocp.args.JsonSave(dict(config))
        t0 = time.perf_counter()
        self._mgr.save(step, args=ocp.args.Composite(**args), force=True)
        self.last_saved = step
        logging.info("checkpoint %s/%d: save started (%.2fs blocking)", self.directory, step,
                     time.perf_counter() - t0)

    def wait(self) -> None:
        """Blocks until the pending save is on disk."""
        self._mgr.wait_until_finished()

    def close(self) -> None:
        self._mgr.close()

    # -- reading -------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Finished checkpoint steps, oldest first."""
        self._mgr.reload()
        return sorted(self._mgr.all_steps())

    def step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def read_json(self, step: int) -> tuple[dict, dict]:
        """(trainer state, config) of a step."""
        try:
            r = self._mgr.restore(step, args=ocp.args.Composite(
                **{TRAINER_ITEM: ocp.args.JsonRestore(), CONFIG_ITEM: ocp.args.JsonRestore()}))
            state, config = r[TRAINER_ITEM], r[CONFIG_ITEM]
        except Exception as e:  # noqa: BLE001 - any read failure means the step is unreadable
            raise CheckpointCorrupt(f"{self.step_dir(step)}: trainer state or config unreadable "
                                    f"({type(e).__name__}: {_short(e)})") from e
        if not isinstance(state, dict) or ARRAYS not in state:
            raise CheckpointCorrupt(f"{self.step_dir(step)}: trainer state lists no arrays")
        return state, config

    def _check_structure(self, step: int, state: dict, targets: Mapping[str, dict]) -> None:
        saved = state[ARRAYS]
        where = self.step_dir(step)
        for item, leaves in targets.items():
            if item not in saved:
                raise CheckpointMismatch(
                    f"{where} has no {item!r} (it holds {sorted(saved)}); was it saved by a run "
                    "with other roles? Resume with the same algorithm, or start a new run "
                    "(trainer.resume=disable, or another trainer.out_dir)")
            missing = sorted(set(leaves) - set(saved[item]))
            extra = sorted(set(saved[item]) - set(leaves))
            if missing or extra:
                raise CheckpointMismatch(
                    f"{where}/{item} does not fit this run: missing {missing[:4]}, unexpected "
                    f"{extra[:4]}; was it saved with another model or optimizer?")
            for name, x in leaves.items():
                rec = saved[item][name]
                if list(rec["shape"]) != list(x.shape) or rec["dtype"] != np.dtype(x.dtype).name:
                    raise CheckpointMismatch(
                        f"{where}/{item}/{name} is {rec['dtype']}{list(rec['shape'])}, this run "
                        f"needs {np.dtype(x.dtype).name}{list(x.shape)}; was it saved with "
                        "another model config?")

    def restore(self, step: int, targets: Targets) -> Restored:
        """Reads one step onto the shardings of `targets` ({item: pytree of arrays or
        ShapeDtypeStructs with shardings}, or a function of the step's trainer state that
        returns them); raises CheckpointCorrupt or CheckpointMismatch."""
        _quiet_closed_loop_callbacks()  # before: a failed read's late callbacks come at once
        return self._restore(step, targets)

    def _restore(self, step: int, targets: Targets) -> Restored:
        state, config = self.read_json(step)
        if callable(targets):
            targets = targets(state)
        named = {item: named_leaves(tree) for item, tree in targets.items()}
        self._check_structure(step, state, named)
        abstract = {item: {k: _abstract(v) for k, v in leaves.items()}
                    for item, leaves in named.items()}
        try:
            arrays_of = self._read_arrays(step, state[ARRAYS], abstract)
        except Exception as e:  # noqa: BLE001
            raise CheckpointCorrupt(f"{self.step_dir(step)}: arrays unreadable "
                                    f"({type(e).__name__}: {_short(e)})") from e
        items = {}
        for item, tree in targets.items():
            arrays = arrays_of[item]
            got = fingerprints(arrays)
            want = state[ARRAYS][item]
            bad = [k for k in named[item] if got[k] != want[k]["fingerprint"]]
            if bad:
                raise CheckpointCorrupt(f"{self.step_dir(step)}/{item}: {len(bad)} array(s) "
                                        f"differ from what was saved, e.g. {bad[0]}")
            treedef = jax.tree_util.tree_structure(tree)
            items[item] = jax.tree_util.tree_unflatten(treedef, [arrays[k] for k in named[item]])
        state = {k: v for k, v in state.items() if k != ARRAYS}
        return Restored(step=step, items=items, state=state, config=config)

    def _read_arrays(self, step: int, saved: dict, abstract: dict[str, dict]) -> dict:
        """{item: {name: array on its target sharding}}: what Orbax saved collectively read by
        Orbax (onto targets that span every process; as host arrays for the others), and
        what the processes saved each for itself (`ckpt_shards`) from their files."""
        args, split = {}, {}
        for item, leaves in abstract.items():
            whole = {k for k in leaves if not saved[item][k].get("per_process")}
            split[item] = whole
            if whole:
                args[item] = ocp.args.StandardRestore(
                    {k: leaves[k] if ckpt_shards.spans_all_processes(leaves[k])
                     else np.empty(leaves[k].shape, leaves[k].dtype) for k in whole})
            if len(whole) < len(leaves):
                args[item + ckpt_shards.SUFFIX] = ckpt_shards.PerProcessRestore()
        r = self._mgr.restore(step, args=ocp.args.Composite(**args))
        out = {}
        for item, leaves in abstract.items():
            got = {}
            for k, like in leaves.items():
                if k in split[item]:
                    x = r[item][k]
                    got[k] = x if isinstance(x, jax.Array) else ckpt_shards.place(
                        lambda x=x: np.asarray(x), like)
                else:
                    files = r[item + ckpt_shards.SUFFIX]
                    got[k] = ckpt_shards.place(
                        lambda files=files, k=k, like=like: files.host(k, like.shape,
                                                                        like.dtype), like)
            out[item] = got
        return out

    def restore_latest(self, targets: Targets, step: int | None = None) -> Restored:
        """Restores `step`, or else the newest readable step, passing over corrupt ones with a
        warning that names each; raises CheckpointCorrupt when none is readable."""
        steps = self.steps()
        if step is not None:
            if step not in steps:
                raise FileNotFoundError(f"no checkpoint step {step} in {self.directory} "
                                        f"(steps: {steps})")
            return self.restore(step, targets)
        if not steps:
            raise FileNotFoundError(f"no checkpoints in {self.directory}")
        skipped, errors = [], []
        for s in reversed(steps):
            try:
                out = self.restore(s, targets)
            except CheckpointCorrupt as e:
                skipped.append(self.step_dir(s))
                errors.append(e)
                continue
            # Told only once a fallback has worked; when none does, the one error says it all.
            for where, e in zip(skipped, errors):
                logging.warning("checkpoint %s is corrupt or partial, falling back to an earlier "
                                "one: %s", where, e)
            out.skipped = skipped
            return out
        run = os.path.dirname(self.directory)
        raise CheckpointCorrupt(
            f"every checkpoint in {self.directory} is corrupt (steps "
            f"{', '.join(os.path.basename(p) for p in reversed(skipped))}; the newest: "
            f"{errors[0]}); to start this run over, move the directory aside (mv "
            f"{self.directory} {self.directory}.bad) and rerun, or start a new run elsewhere: "
            f"--config.trainer.out_dir={run}-new")

    def set_aside(self, steps: list[int], reason: str = "corrupt") -> list[str]:
        """Moves the given step directories to `<root>.<reason>/` (so new saves may reuse their
        step numbers) and returns where they went (in process 0; the other processes of a run
        wait for it and return [])."""
        moved = []
        # The processes of a run share the directory: process 0 moves (and returns what it
        # moved), the others wait for it.
        for s in steps if jax.process_index() == 0 else ():
            src = self.step_dir(s)
            if not os.path.isdir(src):
                continue
            dst_root = f"{self.directory}.{reason}"
            os.makedirs(dst_root, exist_ok=True)
            dst = os.path.join(dst_root, f"{s}-{time.strftime('%Y%m%d-%H%M%S')}")
            shutil.move(src, dst)
            moved.append(dst)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("hfjax checkpoint set_aside")
        self._mgr.reload()
        return moved


class _AbandonedReadFilter(logging_std.Filter):
    """Drops asyncio's "Task/Future exception was never retrieved" report for Orbax's reads:
    when one array of a restore fails, the restore gives up and the other arrays' reads,
    failing the same way, are left unawaited; asyncio logs each when it is collected (an
    Orbax deserialize task, or a bare tensorstore future naming its spec), possibly during a
    later restore. The first failure is what the restore reports (and the fallback warning
    names it)."""

    def filter(self, record: logging_std.LogRecord) -> bool:
        message = record.getMessage()
        return not ("never retrieved" in message
                    and ("deserialize" in message or "tensorstore_spec" in message))


def _quiet_closed_loop_callbacks() -> None:
    """When a restore fails part way, tensorstore reads still in flight complete later and
    call back into the event loop Orbax has closed by then; Python reports each as an
    unraisable "RuntimeError: Event loop is closed" traceback, and asyncio each unawaited
    failed read as "Task exception was never retrieved". They are harmless (the restore was
    abandoned and the fallback reads afresh), so they are dropped, counted at debug level;
    every other unraisable error or asyncio report still goes where it went."""
    asyncio_log = logging_std.getLogger("asyncio")
    if not any(isinstance(f, _AbandonedReadFilter) for f in asyncio_log.filters):
        asyncio_log.addFilter(_AbandonedReadFilter())
    previous = sys.unraisablehook
    if getattr(previous, "_hfjax_closed_loop_filter", False):
        return

    def hook(unraisable):
        err = unraisable.exc_value
        if isinstance(err, RuntimeError) and str(err) == "Event loop is closed":
            logging.vlog(1, "dropped a late tensorstore callback after an abandoned restore")
            return
        previous(unraisable)

    hook._hfjax_closed_loop_filter = True
    sys.unraisablehook = hook


def resume_source(ckpt: RunCheckpointer | None, mode: str = "auto"
                  ) -> tuple[RunCheckpointer, int | None] | None:
    """Where a run's `trainer.resume` setting says to restore from: (checkpointer, step or None
    for its newest), or None for a fresh start.

    - "auto": the newest readable checkpoint in `ckpt` (the run's own), if it has any;
    - "disable": a fresh start, refused when `ckpt` already holds checkpoints;
    - a path (a run's out_dir, a checkpoint root or one step directory): that checkpoint.

    Raises ValueError, before anything is restored or written, when the setting contradicts
    what `ckpt` already holds.
    """
    mode = str(mode or "auto")
    own = ckpt.steps() if ckpt is not None else []
    if mode == "disable":
        if own:
            raise ValueError(
                f"trainer.resume=disable, but {ckpt.directory} already holds checkpoints "
                f"(steps {own}); use trainer.resume=auto to continue that run, or choose "
                "another trainer.out_dir")
        return None
    if mode == "auto":
        return (ckpt, None) if own else None
    root, step = locate(mode)
    if ckpt is not None and root == ckpt.directory:
        return ckpt, step
    if own:
        raise ValueError(
            f"trainer.resume={mode}, but this run's {ckpt.directory} already holds "
            f"checkpoints (steps {own}); choose another trainer.out_dir")
    return RunCheckpointer(root, read_only=True), step


def _short(e: BaseException, n: int = 200) -> str:
    s = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return s[:n]


def config_diff(saved: Mapping[str, Any], current: Mapping[str, Any],
                prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two nested config dicts."""
    out = []
    for k in sorted(set(saved) | set(current)):
        a, b = saved.get(k), current.get(k)
        key = f"{prefix}{k}"
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out += config_diff(a, b, key + ".")
        elif json.dumps(a, sort_keys=True, default=str) != json.dumps(b, sort_keys=True,
                                                                       default=str):
            out.append(key)
    return out

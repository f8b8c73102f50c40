"""Checkpoint items for arrays that do not span every process (hfjax.run.checkpoint).

Orbax saves a `jax.Array` across processes collectively, and only one that has devices on
every process: in a job with a pool per process (`gen=4:rollout;train=4:actor+ref+reward`),
the trainer's arrays are fully addressable on one process and absent from the others, and
Orbax refuses them ("Cannot serialize host local jax.Array in multi-host setting"). Such
arrays go into a `<item>.per_process` item of the same step instead: every process takes part
in the save (the step is one Orbax save, finalized once), and each writes the shards it holds
(replica 0 of each, so a shard is written once) to `process_<index>.npz` in that item's
directory, keyed by array name and index. A restore reads the shards of every process's file
and places each array on the current run's sharding, whatever layout saved it, so a checkpoint
moves between layouts (and to a one-process run) as an Orbax one does.

Writing these files is part of the save's blocking time (the host copy is taken first; the
write itself is synchronous), unlike Orbax's asynchronous writes.
"""

from __future__ import annotations

import dataclasses
import glob
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

SUFFIX = ".per_process"


def spans_all_processes(x: Any) -> bool:
    """Whether Orbax can save `x` collectively: it has devices on every process (always true
    in a one-process run, and for anything that is not a jax.Array)."""
    if jax.process_count() == 1 or not isinstance(x, jax.Array):
        return True
    return len({d.process_index for d in x.sharding.device_set}) == jax.process_count()


def _index_key(name: str, index: tuple) -> str:
    parts = [f"{s.start or 0}:{'' if s.stop is None else s.stop}" for s in index]
    return f"{name}|{','.join(parts)}"


def _parse_index(text: str, shape: tuple) -> tuple:
    if not text:
        return ()
    out = []
    for part, size in zip(text.split(","), shape, strict=True):
        lo, hi = part.split(":")
        out.append(slice(int(lo), int(hi) if hi else size))
    return tuple(out)


def _bits(a: np.ndarray) -> np.ndarray:
    # Saved as unsigned integers of the same width: npz does not keep bfloat16 and the like;
    # the dtype is the checkpoint's record of the array (and the restore target's).
    a = np.ascontiguousarray(a)
    return a.view(f"u{a.dtype.itemsize}")


def own_shards(arrays: Mapping[str, jax.Array]) -> dict[str, np.ndarray]:
    """{name|index: host copy} of the shards of `arrays` this process writes (replica 0)."""
    out = {}
    with jax.transfer_guard("allow"):
        for name, x in arrays.items():
            for shard in x.addressable_shards:
                if shard.replica_id == 0:
                    out[_index_key(name, shard.index)] = _bits(np.asarray(shard.data))
    return out


class PerProcessHandler(ocp.CheckpointHandler):
    """Writes each process's shards to its own file; reads every process's files."""

    def save(self, directory, args: PerProcessSave) -> None:
        os.makedirs(os.fspath(directory), exist_ok=True)
        if args.shards:
            path = os.path.join(os.fspath(directory), f"process_{jax.process_index()}.npz")
            np.savez(path, **args.shards)

    def restore(self, directory, args: PerProcessRestore | None = None) -> ShardFiles:
        return ShardFiles(os.fspath(directory))


@ocp.args.register_with_handler(PerProcessHandler, for_save=True)
@dataclasses.dataclass
class PerProcessSave(ocp.args.CheckpointArgs):
    shards: dict[str, np.ndarray]


@ocp.args.register_with_handler(PerProcessHandler, for_restore=True)
@dataclasses.dataclass
class PerProcessRestore(ocp.args.CheckpointArgs):
    pass


class ShardFiles:
    """The shards of a `.per_process` item, read by array name."""

    def __init__(self, directory: str):
        self.files = [np.load(p) for p in sorted(glob.glob(os.path.join(directory,
                                                                         "process_*.npz")))]
        self.index: dict[str, list] = {}
        for f in self.files:
            for key in f.files:
                name, _, where = key.rpartition("|")
                self.index.setdefault(name, []).append((f, key, where))

    def host(self, name: str, shape: tuple, dtype) -> np.ndarray:
        """The whole array `name`, assembled from its shards; KeyError when a file is missing."""
        if name not in self.index:
            raise KeyError(f"no shard of {name}")
        dtype = np.dtype(dtype)
        out = np.zeros(shape, dtype)
        covered = 0
        for f, key, where in self.index[name]:
            index = _parse_index(where, tuple(shape))
            part = f[key].view(dtype)
            out[index] = part.reshape(out[index].shape)
            covered += part.size
        if covered != out.size:
            raise KeyError(f"shards of {name} cover {covered} of its {out.size} elements")
        return out


def place(read, like: jax.ShapeDtypeStruct) -> jax.Array:
    """An array on the sharding of `like` from `read()`, a host copy of the whole of it, read
    only where this process holds some of the sharding's devices (each uploads its shards)."""
    cache = []

    def shard(index):
        if not cache:
            cache.append(read())
        return cache[0][index]

    with jax.transfer_guard("allow"):
        return jax.make_array_from_callback(like.shape, like.sharding, shard, dtype=like.dtype)

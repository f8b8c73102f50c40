"""Analysis code, not part of the library: the baselines bench/hybrid_engine.py measures the
3D-HybridEngine against.

- `naive_to_decode`: the DeepSpeed-Chat way, every parameter gathered whole on every device and
  the decode shards sliced out of it (what `HybridEngine.naive_bytes()` counts);
- `table2_bytes`: the HybridFlow paper's Table 2 transition volume for a Megatron-style layout.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hfjax.engine.hybrid import HybridEngine, TransitionStats
from hfjax.parallel import reshard
from hfjax.parallel import sharding as shd


def table2_bytes(t: int, t_g: int, model_bytes: float) -> float:
    """Returns the paper's Table 2 HybridFlow volume (t - t_g)/(t_g * t) * M (p = p_g = 1)."""
    return (t - t_g) / (t_g * t) * model_bytes


def naive_to_decode(engine: HybridEngine, params: Any) -> tuple[Any, TransitionStats]:
    """The DS-Chat baseline: gathers every parameter whole on every device, then slices the
    decode shards out; the training params are kept.

    Returns (the decode-layout params, stats with counted bytes and measured peak).
    """
    leaves, treedef = shd.flatten_state(params)
    values = [shd.leaf_value(v) for v in leaves]
    full_train = NamedSharding(engine.train_mesh, P())
    full_decode = NamedSharding(engine.decode_mesh, P())
    t0 = time.perf_counter()
    gathered = _naive_gather(full_train)(values)
    sliced = _naive_slice(tuple(engine.decode_shardings()))(
        [reshard.relabel(g, full_decode) for g in gathered]
    )
    jax.block_until_ready(sliced)
    seconds = time.perf_counter() - t0
    # Training params, the whole gathered model and the decode shards are all alive here.
    peak = reshard.array_bytes([*values, *gathered, *sliced])
    for g in gathered:
        g.delete()
    stats = TransitionStats("to_decode", "naive", seconds, engine.naive_bytes(), peak)
    out = jax.tree.unflatten(treedef, [shd.with_value(v, y) for v, y in zip(leaves, sliced)])
    return out, stats


@functools.lru_cache(maxsize=32)
def _naive_gather(full: NamedSharding) -> Callable:
    return jax.jit(lambda xs: xs, out_shardings=full)


@functools.lru_cache(maxsize=32)
def _naive_slice(shardings: tuple[NamedSharding, ...]) -> Callable:
    return jax.jit(lambda xs: xs, out_shardings=list(shardings))

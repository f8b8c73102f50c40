"""Timing shared by the benchmarks."""

import time

import jax


def best_time(fn, *args, reps: int) -> tuple[float, list[float]]:
    """(fastest, all) wall times of `reps` calls of fn(*args), each waited for, after one
    untimed call that compiles. Other jobs on a shared machine only ever slow a sample down,
    so the fastest is the estimate."""
    jax.block_until_ready(fn(*args))
    runs = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        runs.append(time.perf_counter() - start)
    return min(runs), runs

"""Asynchronous rollout: the rollout pool generates the batches of later steps while the
trainer updates on the current one, each sample at most `max_staleness` (K) updates old
(docs/async.md).

The schedule is fixed by the step numbers, never by timing, so a run is reproducible:

- the batch the trainer consumes at step s is generated with policy version `version_of(s)`,
  the oldest pushed version the bound admits: the smallest multiple of `push_every` that is at
  least s - K (and at least the version the run started from). Version v is the actor after v
  updates; the trainer pushes it after update v when v is a multiple of `push_every`.
- at step t the trainer issues the prompts of every step up to t + K (drawn from the data in
  order) and no further: a batch that could not meet the bound is never started, so none is
  ever thrown away, and the trainer consumes them oldest first.
- with partial rollouts, the batch of step s switches to `switch_of(s)`, the next pushed
  version after `version_of(s)` when it is at most s (it lands while the batch decodes), at
  response column `partial_column(response_length)` (halfway): rows still decoding there keep
  their prefix and continue under it (`hfjax.workers.rollout.generate_partial`).

In one process a rollout thread runs the issued jobs in order; it waits for a job's version to
arrive (a push builds it beside the weights decoding reads, and the thread swaps at the next
job: double buffering). With K = 0 the same thread makes each batch when its step issues it and
the trainer waits for it in its "gen" stage: the synchronous loop on two pools, through the
machinery of K >= 1 with no overlap. Across processes (`jax.distributed`) there is no thread:
every process runs the same single-threaded schedule. At each step with K >= 1 the step's batch
(made at an earlier step) comes home first, then the generation of the steps issued ahead is
dispatched, then the trainer's step (with K = 0 the step's "gen" stage generates its batch and
brings it home); a step issued before its version exists (`push_every` > 1) is dispatched by
the push that brings that version. With partial rollouts a batch's first columns are
dispatched with it and the rest by the push of the version they continue under (the rows come
to every process's host there). Each process only computes the programs of its own devices
(the others' are no-ops there), so the rollout pool's process generates while the trainer's
process updates, and every cross-process collective (the batch coming home, the push, host
fetches) is issued in the same order on every process.

A batch stays on the rollout pool until its step takes it; then its response columns that are
padding in every row are cut (as the synchronous loop's generate does) and it moves to the
trainer's mesh. Every token carries its version (`token_versions`, [B, R]).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hfjax.controller.batch import Batch
from hfjax.controller.protocol import DP_COMPUTE
from hfjax.engine.buckets import MIN_NEW_TOKENS_BUCKET, bucket_size
from hfjax.parallel.transfer import to_host
from hfjax.workers import rollout as rollout_lib
from hfjax.workers.actor import ActorRollout


def version_of(step: int, max_staleness: int, push_every: int, start: int = 0) -> int:
    """The policy version that generates the batch of `step` (see the module docstring)."""
    lo = step - max_staleness
    # Pushed: the version the run started from, then every multiple of push_every after it.
    return start if lo <= start else -(-lo // push_every) * push_every


def switch_of(step: int, max_staleness: int, push_every: int, start: int = 0) -> int | None:
    """With partial rollouts, the version the batch of `step` continues under: the first one
    pushed after `version_of(step)` (the push that lands while the batch decodes), or None
    when that one comes after the trainer needs the batch (later than `step`)."""
    first = version_of(step, max_staleness, push_every, start)
    after = (first // push_every + 1) * push_every
    return after if after <= step else None


@dataclasses.dataclass
class _Job:
    step: int
    prompts: Batch
    version: int
    data_state: dict  # the data cursor before this job's rows were drawn
    switch: int | None = None  # partial rollouts: the version its unfinished rows continue under


class AsyncRollout:
    """The rollout pool's side of an asynchronous run: its group (`rollout`), the weights of
    each pushed version it still needs, the jobs issued and the batches made."""

    def __init__(self, actor: ActorRollout, rollout: ActorRollout, *, max_staleness: int,
                 push_every: int, start_version: int,
                 prompts: Callable[[int], tuple[Batch, dict]], threaded: bool | None = None,
                 partial_rollout: bool = False):
        self.actor, self.rollout = actor, rollout
        self.k, self.every, self.start = int(max_staleness), int(push_every), int(start_version)
        # A rollout thread in one process; across processes one schedule on one thread.
        self.threaded = (jax.process_count() == 1) if threaded is None else threaded
        self.partial = bool(partial_rollout)
        if self.partial and self.k < 1:
            raise ValueError("partial rollouts need max_staleness >= 1; set "
                             "async_rollout.partial_rollout=False")
        self._continued: dict[int, float] = {}  # step -> fraction of its rows continued
        self._prompts = prompts  # step -> (host prompts, data cursor before drawing them)
        self._cv = threading.Condition()
        self._weights: dict[int, Any] = {}
        self._jobs: collections.deque[_Job] = collections.deque()
        self._pending: collections.deque[_Job] = collections.deque()  # issued, not consumed
        self._made: dict[int, Batch] = {}
        # Across processes: jobs issued, not yet dispatched (`_dispatch`), and partial
        # rollouts' first columns, dispatched, waiting for the version they continue under.
        self._deferred: collections.deque[_Job] = collections.deque()
        self._heads: dict[int, tuple[_Job, Any]] = {}
        self._error: BaseException | None = None
        self._closed = False
        self._idle_rollout = 0.0
        # Across processes each pool's idle time is measured on a process that holds its
        # devices and none of the other pool's; and on the rollout's, when the current step
        # began and the seconds it has generated since.
        here = jax.process_index()
        holds_rollout = any(d.process_index == here for d in rollout.mesh.devices.flat)
        holds_actor = any(d.process_index == here for d in actor.mesh.devices.flat)
        self._rollout_side = holds_rollout and not holds_actor
        self._trainer_side = holds_actor and not holds_rollout
        self._mark: float | None = None
        self._busy = 0.0
        self._issued = start_version  # the next step to issue
        self._thread: threading.Thread | None = None
        self._metrics: dict[str, float] = {}
        self.push(start_version)

    # -- the trainer's side ----------------------------------------------------------------

    def push(self, version: int) -> None:
        """Moves the actor's current weights (version `version`) to the rollout pool."""
        params, seconds = rollout_lib.push(self.actor, self.rollout)
        with self._cv:
            self._weights[version] = params
            self._cv.notify_all()
        if not self.threaded:
            self._dispatch()
        self._metrics["async/push_bytes"] = float(rollout_lib.param_bytes(params))
        self._metrics["async/push_s"] = seconds

    def after_update(self, version: int) -> None:
        """Called once the update that made `version` has finished: pushes when due."""
        if version % self.every == 0:
            self.push(version)

    def saved_versions(self, step: int) -> list[int | None]:
        """The older weights a checkpoint at `step` holds, one per slot (K slots): slot i holds
        version step - 1 - i when a batch waiting for the trainer was made with it (None:
        the slot holds the current weights, unused). With them a resumed run remakes those
        batches exactly as they were made (their prompts from the data cursor, their seeds from
        the step)."""
        need = set().union(*(self._job_versions(j.step) for j in self._pending))
        return [step - 1 - i if step - 1 - i in need else None for i in range(self.k)]

    def saved_weights(self, step: int, current) -> dict[str, Any]:
        """{slot item name: params on the rollout pool} for `saved_versions(step)`."""
        versions = self.saved_versions(step)
        with self._cv:
            return {slot_name(i): current if v is None else self._weights[v]
                    for i, v in enumerate(versions)}

    def state(self, step: int) -> dict:
        """The JSON state a checkpoint at `step` holds with `saved_weights`."""
        return {"start": self.start, "versions": self.saved_versions(step),
                "partial_rollout": self.partial}

    def restore(self, step: int, state: dict, items: dict[str, Any]) -> None:
        """Installs a checkpoint's async state at `step` (before the first `take`): the
        schedule's origin, the saved older weights, and the current actor's as version
        `step`."""
        assert self._thread is None and not self._pending, "restore before the first take"
        self.start, self._issued = int(state["start"]), step
        with self._cv:
            self._weights = {v: items[slot_name(i)]
                             for i, v in enumerate(state["versions"]) if v is not None}
        # The older versions the batches to remake need must be in the checkpoint (a run saved
        # without partial rollouts holds no version that only a switch needs).
        missing = sorted(v for s in range(step, step + self.k) for v in self._job_versions(s)
                         if v < step and v not in self._weights)
        if missing:
            was = bool(state.get("partial_rollout", False))
            raise ValueError(f"the checkpoint of step {step} lacks the weights of versions "
                             f"{missing} that its queued batches need; resume with "
                             f"--config.async_rollout.partial_rollout={was}")
        self.push(step)

    def data_state(self) -> dict | None:
        """The data cursor before the oldest issued batch not yet consumed (what a checkpoint
        saves, so that a resumed run issues those prompts again), or None when none is."""
        return self._pending[0].data_state if self._pending else None

    def take(self, step: int) -> tuple[Batch, Callable[[], Batch]]:
        """(the host prompts of `step`, a function giving its generated batch), issuing every
        step the bound admits first. With K >= 1 the batch is waited for here; with K = 0 the
        function waits for it (the driver's "gen" stage: on two pools in turn, the trainer
        idles while the rollout pool generates)."""
        now = time.perf_counter()
        if not self.threaded and self._mark is not None:  # the previous step's period
            self._idle_rollout = max(now - self._mark - self._busy, 0.0)
        self._mark, self._busy = now, 0.0
        issued = []
        for s in range(self._issued, step + self.k + 1):
            prompts, cursor = self._prompts(s)
            version, switch = self._schedule(s)
            job = _Job(s, prompts, version, cursor, switch)
            self._pending.append(job)
            issued.append(job)
            if self.threaded:  # K = 0 too: the same thread and double buffer, no overlap
                with self._cv:
                    self._jobs.append(job)
                    self._cv.notify_all()
        self._issued = max(self._issued, step + self.k + 1)
        assert self._pending and self._pending[0].step == step, "steps consumed out of order"
        self._drop_unneeded()
        job = self._pending.popleft()
        if not self.threaded:
            return job.prompts, self._take_in_turn(step, job, issued, now)
        self._start()
        if self.k == 0:
            return job.prompts, lambda: self._home(self._wait(step), job.version)
        batch = self._home(self._wait(step), job.version)
        return job.prompts, lambda: batch

    def _take_in_turn(self, step: int, job: _Job, issued: list[_Job],
                      t0: float) -> Callable[[], Batch]:
        """`take` with no rollout thread (across processes): this step's batch comes home
        first, then the generation of the steps issued ahead is dispatched. In that order the
        rollout's process generates them while the trainer's process trains on this one; the
        other order would keep the trainer waiting for the batch of a later step."""
        self._metrics["timing_s/idle/rollout"] = (self._idle_rollout if self._rollout_side
                                                  else float("nan"))
        if self.k == 0:
            def made() -> Batch:
                t1 = time.perf_counter()
                batch = self._home(self._generate(job), job.version)
                self._metrics["timing_s/idle/train"] = self._wait_seconds(t1)
                return batch

            return made
        self._deferred.extend(issued)
        self._dispatch(upto=step)  # at the first step, the batches up to this one
        batch = self._home(self._made.pop(step), job.version)
        self._metrics["timing_s/idle/train"] = self._wait_seconds(t0)
        self._dispatch()
        return lambda: batch

    def _dispatch(self, upto: int | None = None) -> None:
        """Across processes: dispatches the generation of the issued jobs, oldest first, whose
        versions have been pushed (up to step `upto`); the others wait for their push, which
        dispatches them (with `push_every` > 1 a job can be issued before its version
        exists). Every process dispatches at the same points of the schedule."""
        while (self._deferred and self._deferred[0].version in self._weights
               and (upto is None or self._deferred[0].step <= upto)):
            job = self._deferred.popleft()
            if job.switch is None:
                self._made[job.step] = self._generate(job)
            else:  # its first columns now, the rest once its switch version is pushed
                head = rollout_lib.partial_head(self.rollout, job.prompts,
                                                self._swap(job.version))
                self._heads[job.step] = (job, head)
        for step in sorted(self._heads):
            job, head = self._heads[step]
            if job.switch in self._weights:
                del self._heads[step]
                batch, continued = rollout_lib.partial_rest(
                    self.rollout, job.prompts, head, job.version, self._swap(job.switch),
                    job.switch)
                self._continued[step] = continued
                self._made[step] = batch

    def _wait_seconds(self, t0: float) -> float:
        """Across processes, the seconds since `t0` the trainer's process spent getting its
        batch (NaN on another process: there they are not a wait)."""
        if not self._trainer_side:
            return float("nan")
        return time.perf_counter() - t0

    def _wait(self, step: int) -> Batch:
        """The batch of `step` from the rollout thread, once it has made it."""
        t0 = time.perf_counter()
        with self._cv:
            while step not in self._made and self._error is None:
                self._cv.wait()
            if self._error is not None:
                raise RuntimeError("the rollout thread failed") from self._error
            batch = self._made.pop(step)
            self._metrics["timing_s/idle/rollout"] = self._idle_rollout
            self._idle_rollout = 0.0
        self._metrics["timing_s/idle/train"] = time.perf_counter() - t0
        return batch

    def metrics(self, step: int, batch: Batch) -> dict:
        """This step's async metrics: push bytes and seconds, idle times (host floats) and
        the staleness of every response token the trainer sees at `step` (device scalars)."""
        out = dict(self._metrics)
        self._metrics = {k: v for k, v in self._metrics.items() if k.startswith("async/push")}
        if self.partial:
            with self._cv:
                out["async/partial/rows"] = self._continued.pop(step, 0.0)
        if not self.threaded:
            out |= self._from_pools(out)
        with jax.transfer_guard("allow"):  # the step number: one scalar upload
            mean, worst = _staleness(batch["token_versions"], batch["response_mask"],
                                     _scalar(step, batch["response_mask"]))
        return out | {"async/staleness/mean": mean, "async/staleness/max": worst}

    def _from_pools(self, metrics: dict) -> dict:
        """Across processes each pool's idle time is measured on its own process (NaN on the
        others): placed on that pool's devices, where only its process's value lands, it
        comes back to every process with the step's one metrics fetch."""
        out = {}
        with jax.transfer_guard("allow"):  # one scalar upload each
            for key, mesh in (("timing_s/idle/rollout", self.rollout.mesh),
                              ("timing_s/idle/train", self.actor.mesh)):
                if key in metrics:
                    out[key] = jax.device_put(np.float32(metrics[key]), NamedSharding(mesh, P()))
        return out

    def close(self) -> None:
        """Stops the rollout thread (after its current job)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    # -- the rollout's side ------------------------------------------------------------------

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="hfjax-rollout",
                                            daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        try:
            while True:
                t0 = time.perf_counter()
                with self._cv:
                    while not self._closed and not self._jobs:
                        self._cv.wait()
                    if self._closed:
                        return
                    job = self._jobs.popleft()
                    self._idle_rollout += time.perf_counter() - t0
                if not self._wait_for(job.version):
                    return
                batch = self._generate(job)
                jax.block_until_ready(batch.arrays)
                with self._cv:
                    self._made[job.step] = batch
                    self._cv.notify_all()
        except _Closed:
            return
        except BaseException as err:  # handed to the trainer, which raises it
            with self._cv:
                self._error = err
                self._cv.notify_all()

    def _wait_for(self, version: int) -> bool:
        """Waits (counted as the rollout's idle time) until `version` has been pushed; False
        when the rollout is closed first."""
        t0 = time.perf_counter()
        with self._cv:
            while not self._closed and version not in self._weights:
                self._cv.wait()
            self._idle_rollout += time.perf_counter() - t0
            return not self._closed

    def _swap(self, version: int):
        with self._cv:
            # The swap: decoding reads this version from now on (older ones are dropped once
            # no batch waiting for the trainer was made with them: a checkpoint saves those).
            self.rollout.params = self._weights[version]
            return self.rollout.params

    def _generate(self, job: _Job) -> Batch:
        first = self._swap(job.version)
        if job.switch is None:
            t0 = time.perf_counter()
            batch = self.rollout.generate(job.prompts)
            if not self.threaded and self._rollout_side:  # the seconds it kept its devices busy
                jax.block_until_ready(batch.arrays)
                self._busy += time.perf_counter() - t0
            return batch

        def second():  # after the first columns: the pushed version the rows continue under
            if not self._wait_for(job.switch):
                raise _Closed
            return self._swap(job.switch)

        batch, continued = rollout_lib.generate_partial(self.rollout, job.prompts, first,
                                                        job.version, second, job.switch)
        with self._cv:
            self._continued[job.step] = continued
        return batch

    def _schedule(self, step: int) -> tuple[int, int | None]:
        """(the version the batch of `step` starts under, the one it switches to or None)."""
        first = version_of(step, self.k, self.every, self.start)
        return first, switch_of(step, self.k, self.every, self.start) if self.partial else None

    def _job_versions(self, step: int) -> set[int]:
        """The versions the batch of `step` is generated with."""
        return set(self._schedule(step)) - {None}

    def _drop_unneeded(self) -> None:
        with self._cv:
            keep = min(j.version for j in self._pending)
            for v in [v for v in self._weights if v < keep]:
                del self._weights[v]

    def _home(self, batch: Batch, version: int) -> Batch:
        """A generated batch on the trainer's mesh, cut to the responses' longest length (a
        power-of-two bucket, as `workers.responses.trim`), its tokens tagged with `version`."""
        batch = DP_COMPUTE.collect(cut_responses(batch), 0, self.actor.mesh)
        if "token_versions" in batch.arrays:  # partial rollouts: tagged token by token
            return batch
        with jax.transfer_guard("allow"):  # the version number: one scalar upload
            versions = _versions(batch["response_mask"], _scalar(version, batch["response_mask"]))
        return batch.union(Batch({"token_versions": versions}))


def cut_responses(batch: Batch) -> Batch:
    """`batch` without the response columns that are padding in every row, kept to a
    power-of-two width (at least MIN_NEW_TOKENS_BUCKET): what `workers.responses.trim` does to a
    synchronous generate's output, here on a whole generated batch (a host read of one
    scalar)."""
    width = batch["responses"].shape[1]
    if width <= MIN_NEW_TOKENS_BUCKET:
        return batch
    longest = int(to_host(_longest(batch["response_mask"])))
    keep = bucket_size(longest, MIN_NEW_TOKENS_BUCKET, cap=width)
    if keep == width:
        return batch
    prompt = batch["prompts"].shape[1]
    cut = {k: _cut(batch[k], keep) for k in _RESPONSE_KEYS if k in batch.arrays}
    cut |= {k: _cut(batch[k], prompt + keep) for k in _JOINED_KEYS}
    # Arrays only: the rows' meta (data_source, ground_truth, ...) comes along as it is.
    return batch.select([k for k in batch.arrays if k not in cut]).union(Batch(cut))


def slot_name(i: int) -> str:
    """The checkpoint item of the i-th saved older version (`AsyncRollout.saved_weights`)."""
    return f"async_weights_{i}"


_RESPONSE_KEYS = ("responses", "response_mask", "rollout_log_probs", "token_versions")
_JOINED_KEYS = ("input_ids", "attention_mask")


class _Closed(Exception):
    """The rollout was closed while a job waited for its second version."""


def _scalar(value: int, like: jax.Array) -> jax.Array:
    """`value` placed replicated on `like`'s mesh: across processes a scalar left on a
    process's default device cannot join a program on another process's devices."""
    return jax.device_put(np.int32(value), NamedSharding(like.sharding.mesh, P()))


@jax.jit
def _longest(mask):
    return jnp.max(jnp.sum(mask, axis=1))


def _cut(x, cols: int):
    # A static slice with strides: run eagerly, plain indexing uploads its start indices.
    return jax.lax.slice(x, (0,) * x.ndim, (x.shape[0], cols, *x.shape[2:]), (1,) * x.ndim)


@jax.jit
def _versions(mask, version):
    return jnp.full(mask.shape, version, jnp.int32)


@jax.jit
def _staleness(versions, mask, step):
    m = mask.astype(jnp.float32)
    age = (step - versions).astype(jnp.float32)
    return jnp.sum(age * m) / jnp.maximum(jnp.sum(m), 1.0), jnp.max(jnp.where(m > 0, age, 0.0))

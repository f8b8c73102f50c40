"""Continuous batching: the rollout engine with a fixed number of decode slots.

The static engine (`hfjax.engine.sampler.Sampler`) decodes every row of a batch until its
longest row stops, so in an RL batch with a wide spread of response lengths much of its work is
on rows that have already finished. This engine decodes through **slots** instead: when a
slot's request stops, the slot takes the next waiting request (its prompt's KV, then decoding
from there) until every request is admitted; then, as slots finish with nothing left to admit,
the busy ones move into fewer slots (the **drain**), so the rows a step computes follow the rows
still decoding. It is a `Sampler` with the same `generate` and the same results: the same
tokens, masks and log-probs row for row (see "Same results").

**One program.** A whole `generate` call is one jitted program. Admission is a
`lax.while_loop` whose body refills the slots and runs up to `refill_every` (k) decode steps;
each drain phase is a loop of up to k steps at a time on its own, smaller slot count (3/4 of the
one before, down to `min_slots`, at most `MAX_DRAIN_PHASES` phases: `drain_sizes`), entered
once few enough slots are busy. Admission and the first drain phase share one loop, so the
program holds one decode step per slot count. Which slot is free,
which request comes next, when to prefill and when to shrink are all decided on device, so
nothing returns to the host until every request is done: no host round trip per token, per
refill or per phase. k trades the refill's fixed cost against the steps a finished slot idles
until the next refill (measured in docs/benchmarks.md).

Where the work goes on this 2-core CPU (docs/benchmarks.md): a decode step's cost grows almost
in proportion to its rows (attention over the cache dominates at a few hundred columns), so the
gain comes from computing fewer rows, which the drain does; refilling a smaller set of slots
does not reduce the rows computed per token, and when most responses run to the cap, a long
request admitted late makes the run longer. `slots=0` (one slot per request, nothing waits)
with the drain is therefore the CPU default; fewer slots bound the KV memory, and pay off where
a step costs about the same for any row count (memory-bound accelerators).

**Requests.** Request r = b * n + j is sample j of prompt b; it is also its output row. Requests
are admitted in that order, so the n samples of a prompt enter one after another.

**Prefill once per prompt.** Prompts are prefilled in windows of `prefill_batch` (G) prompts at
a time, into a staging cache [G, ..., prompt_bucket] plus each prompt's last-position logits.
Admitting request (b, j) copies prompt b's staged KV into the slot's first `prompt_bucket`
columns and samples its first token from the staged logits, so the n samples of a prompt share
one prefill. A window is prefilled when the next request's prompt lies past it; as admission is
in order, the previous window is then no longer needed. Several requests are admitted per round
(`ADMIT_ROWS`), each round a gather from the staging cache and a scatter into the slots.

**Slot layout.** A slot's cache has prompt_bucket + new_bucket columns: the left-padded prompt,
then response token t at column prompt_bucket + t (the decode cache's prompt and response
parts: `hfjax.engine.decode`). That is the static engine's layout for each row, so every row
attends over the same columns in the same order. Decoding writes each slot's
token at its own column (`decode_step` with one column per row). A slot keeps its request's
tokens, mask and log-probs in its own rows while it decodes; when the request is done the next
refill copies them to the request's output row ("retire") and frees the slot. Per step,
everything stays within a slot's row, so on a data-parallel mesh the step's only cross-row
communication is the loop's "any slot live?" test, as in the static engine. A drain phase
starts by gathering the busy slots' rows (cache included) into the smaller slot arrays.

**Same results.** A request's randomness depends only on its own seed and token index: the
prompt key is `fold_in(key(seed_b), salt_b)` (as in the static engine), sample j folds in j and
token t folds in t. Its cache holds the same values at the same columns as in the static engine,
so greedy tokens and seeded samples equal the static engine's token for token, whichever other
requests share the slots (tests/engine/test_continuous.py checks this on 1 device and on
`data=4,tensor=2`). One condition comes from the backend, not from this engine: a row's
arithmetic must not depend on how many rows share a matmul. Matmul kernels pick their blocking
by row count; XLA:CPU computes SmolLM2's decode step bit-identically for any 33 or more rows,
and for any 8 to 32, but not across the two ranges (measured, docs/benchmarks.md). With the
static engine's rows and the slots in different ranges the logits differ in their last bits and
a temperature-1 draw can, rarely, flip. The drain therefore stops, by default, at the lower
end of the row range it starts in (`ROW_RANGES`: 8 to 32 or 33 and more, XLA:CPU's); choose
`slots` the same way (or 0, one per request) where bit-identical rollouts matter.

**Limits.** `max_cache_len` bounds a slot's cache; a request whose prompt plus
`max_new_tokens` does not fit is refused before anything compiles.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import numpy as np
from absl import logging
from flax import nnx

from hfjax.engine.buckets import bucket_size, prompt_bucket
from hfjax.engine.sampler import Sampler
from hfjax.engine.slots import Plan, run_shardings
from hfjax.engine.slots import run as run_program
from hfjax.engine.spec import RolloutSpec
from hfjax.engine.token_select import GenerateOutput, Knobs, SamplingParams
from hfjax.parallel import mesh as mesh_lib
from hfjax.parallel import sharding as sharding_lib

# Row counts from which XLA:CPU computes a decode step's rows bit-identically, up to the next
# entry (measured on SmolLM2-135M: 4-7, 8-32, 33+; module docstring). A drain that stays inside
# one range gives each row the bits a static batch in that range gives it.
ROW_RANGES = (8, 33)
# Drain phases at most (`drain_sizes`): each compiles its own decode step.
MAX_DRAIN_PHASES = 3
# Requests admitted per admission round: the round's gather and scatter cost scales with it,
# and the first fill of all slots takes slots / ADMIT_ROWS rounds.
ADMIT_ROWS = 8


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def drain_sizes(slots: int, floor: int, dp: int = 1) -> tuple[int, ...]:
    """The slot counts of the drain phases after the first: 3/4 of the one before each, down
    to `floor`, multiples of `dp`; when that takes more than MAX_DRAIN_PHASES phases, that
    many in even ratios instead.

    Every phase compiles its own copy of the decode step (its shapes are its own), so the
    phases are most of the rollout program's compile time: 3/4 steps from 200 slots to 33 are
    7 phases, and with the first at 200 the program held 8 decode steps. Fewer, wider steps
    let a phase's rows get less busy before it shrinks (from 200 slots, 55% instead of 75%: a
    few row-steps more in the drain) and give the same tokens: the phases stay in one row
    range."""
    drain, rows = [], slots
    while (fewer := max(floor, _round_up(-(-rows * 3 // 4), dp))) < rows:
        drain.append(rows := fewer)
    if len(drain) <= MAX_DRAIN_PHASES:
        return tuple(drain)
    ratio = (floor / slots) ** (1 / MAX_DRAIN_PHASES)
    steps = [max(floor, _round_up(math.ceil(slots * ratio**i), dp))
             for i in range(1, MAX_DRAIN_PHASES)] + [floor]
    return tuple(sorted({r for r in steps if r < slots}, reverse=True))


# --------------------------------------------------------------------------------------------
# The engine object
# --------------------------------------------------------------------------------------------


class ContinuousSampler(Sampler):
    """A `Sampler` that decodes through a fixed number of slots (module docstring).

    A run builds it with its `rollout` section's values (`rollout_sampler`); the defaults here
    are for direct users (benchmarks, tests).

    Args beyond `Sampler`'s:
      slots: decode slots (at most the requests of a call); 0: one per request, so that
        nothing waits and only the drain phases shrink the rows. On a mesh, a multiple of the
        data-parallel size.
      refill_every: decode steps between refills (k), and between checks of the drain.
      min_slots: the fewest slots the drain shrinks to (rounded up to the data-parallel size);
        0: the start of the slots' row range (ROW_RANGES), or the slots themselves below it.
      prefill_batch: prompts per prefill window; None: enough prompts to fill every slot
        (ceil(slots / n)), rounded up to the data-parallel size.
      max_cache_len: the most cache columns a slot may hold (prompt bucket + new-token
        bucket); None: no limit. A request whose prompt plus max_new_tokens exceeds it is
        refused before compiling.
    """

    def __init__(
        self,
        model: nnx.Module,
        *,
        slots: int = 0,
        refill_every: int = 8,
        min_slots: int = 0,
        prefill_batch: int | None = None,
        max_cache_len: int | None = None,
        **kw: Any,
    ):
        super().__init__(model, **kw)
        for name, value, least in (
            ("slots", slots, 0),
            ("refill_every", refill_every, 1),
            ("min_slots", min_slots, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
                raise ValueError(f"{name}={value!r}; it must be an int >= {least}")
        if slots % self._dp:
            raise ValueError(
                f"slots={slots} does not divide over the decode mesh's {self._dp} data-parallel "
                f"ways; use a multiple of {self._dp} (rollout.slots)"
            )
        if prefill_batch is not None and (
            not isinstance(prefill_batch, (int, np.integer)) or prefill_batch < 1
        ):
            raise ValueError(f"prefill_batch={prefill_batch!r}; it must be a positive int or None")
        if max_cache_len is not None and max_cache_len < 2:
            raise ValueError(f"max_cache_len={max_cache_len!r}; it must be >= 2 or None")
        self.slots = int(slots)
        self.min_slots = int(min_slots)
        self.refill_every = int(refill_every)
        self.prefill_batch = None if prefill_batch is None else int(prefill_batch)
        self.max_cache_len = None if max_cache_len is None else int(max_cache_len)
        mesh = self.mesh
        self._run_shardings = (run_shardings(mesh, self.config, self.decode.layout)
                               if mesh is not None else None)
        self._runs: dict[Plan, Any] = {}
        # Counters of the last call, on device (read them only when needed: reading waits for
        # the rollout): decode_steps, slot_steps, prefill_windows.
        self.last_stats: dict[str, jax.Array] = {}

    def _buckets(self, longest: int, max_new: int) -> tuple[int, int]:
        """(prompt bucket, new-token bucket) of a call, within max_cache_len."""
        width = prompt_bucket(longest, self.min_prompt_bucket)
        new = bucket_size(max_new, self.min_new_tokens_bucket)
        cap = self.max_cache_len
        if cap is None or width + new <= cap:
            return width, new
        if longest + max_new > cap:
            raise ValueError(
                f"a request needs {longest} prompt + {max_new} new tokens = "
                f"{longest + max_new} cache columns, more than a slot's max_cache_len={cap}; "
                "raise max_cache_len (rollout.max_cache_len), or shorten the prompts or "
                "max_new_tokens"
            )
        # Shrink the buckets to fit, keeping room for the longest prompt and every new token.
        width = max(longest, min(width, cap - new))
        return width, min(new, cap - width)

    def _plan(self, prompts: int, width: int, new: int, params: SamplingParams) -> Plan:
        requests = prompts * params.n
        # Both multiples of the data-parallel size; 0 slots: one per request.
        slots = min(self.slots or requests, requests)
        least = self.min_slots or max([r for r in ROW_RANGES if r <= slots], default=slots)
        floor = min(slots, _round_up(least, self._dp))
        drain = drain_sizes(slots, floor, self._dp)
        # A window fills every slot at the start. It also holds at least 2 prompts and 64
        # prompt tokens: matmul kernels choose their blocking by row count, and XLA:CPU rounds a
        # row the same way only within a range of row counts (one row alone, then 2 and more in
        # the LM head, 33 and more in the layers' projections; docs/benchmarks.md), so a
        # narrower prefill than the static engine's could change the first token's last bits.
        want = self.prefill_batch or max(math.ceil(slots / params.n), 2, math.ceil(64 / width))
        g = min(prompts, _round_up(want, self._dp))
        admit = min(slots, _round_up(ADMIT_ROWS, self._dp))
        return Plan(
            prompts=prompts,
            prompt_bucket=width,
            new_bucket=new,
            n=params.n,
            slots=slots,
            prefill_batch=g,
            admit_rows=admit,
            refill_every=self.refill_every,
            drain=tuple(drain),
            **params.selection_key(),
            decode=self.decode,
        )

    def _get_run(self, plan: Plan) -> Any:
        run = self._runs.get(plan)
        if run is None:
            logging.info(
                "hfjax.engine: compiling continuous rollout for %s mesh=%s",
                plan,
                dict(self.mesh.shape) if self.mesh is not None else None,
            )
            fn = functools.partial(run_program, self.graphdef, plan, self._run_shardings)
            run = jax.jit(sharding_lib.under_layout(self._trace_layout, fn))
            self._runs[plan] = run
            self.compile_log.append(plan)
        return run

    def _decode(self, state: nnx.State, ids: np.ndarray, mask: np.ndarray, seeds: np.ndarray,
                salts: np.ndarray, knobs: Knobs, stops: np.ndarray, batch: int,
                params: SamplingParams) -> GenerateOutput:
        """As the static engine's (`generate` gives the same rows, columns and values), decoded
        through the slots."""
        longest = int(mask.sum(axis=1).max())
        width, new = self._buckets(longest, params.max_new_tokens)
        # _prepare left-pads to the static engine's bucket; move to this call's bucket.
        if width < ids.shape[1]:
            ids, mask = ids[:, -width:], mask[:, -width:]
        plan = self._plan(ids.shape[0], width, new, params)
        total = np.int32(batch * params.n)
        run = self._get_run(plan)
        args = (ids, mask, seeds, salts, total, knobs, stops)
        if self.mesh is not None:
            # The request's one deliberate upload; prompts are replicated because any slot
            # may take any prompt.
            with jax.transfer_guard("allow"):
                args = jax.device_put(args, mesh_lib.replicated(self.mesh))
        out, self.last_stats = run(state, *args)
        return out


# --------------------------------------------------------------------------------------------
# Choosing the engine from a config
# --------------------------------------------------------------------------------------------

MODES = ("static", "continuous")


def rollout_sampler(model: nnx.Module, rollout: RolloutSpec, **kw: Any) -> Sampler:
    """The rollout engine a `RolloutSpec` asks for, built with `Sampler` keyword arguments
    `kw` (mesh, max_prompt_len, pad_id, rules, ...).

    `rollout.mode`: "static" (`Sampler`) or "continuous" (`ContinuousSampler` with
    `rollout.slots`, `rollout.refill_every`, `rollout.min_slots` and `rollout.max_cache_len`,
    0 for no limit). Either engine reads its cache as `rollout.decode_attention` and
    `rollout.kv_layout` say (`hfjax.engine.decode.decode_options`).
    Raises TypeError for a config section (build the spec once with `RolloutSpec.of`), and
    ValueError naming the key on a bad setting, before anything compiles.
    """
    RolloutSpec.require(rollout, "rollout_sampler", "rollout")
    kw = {"decode_attention": rollout.decode_attention, "kv_layout": rollout.kv_layout, **kw}
    if rollout.mode == "static":
        return Sampler(model, **kw)
    if rollout.mode != "continuous":
        raise ValueError(f"rollout.mode={rollout.mode!r}; choose one of {', '.join(MODES)}")
    try:
        return ContinuousSampler(model, slots=rollout.slots, refill_every=rollout.refill_every,
                                 min_slots=rollout.min_slots,
                                 max_cache_len=rollout.max_cache_len or None, **kw)
    except ValueError as err:
        raise ValueError(f"rollout (mode=continuous): {err}") from err

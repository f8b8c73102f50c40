"""Multi-turn rollouts: trajectories that alternate policy turns and tool turns.

A trajectory starts from a prompt. A **policy turn** is decoded by the rollout engine (either
`Sampler`: static or continuous batching) and ends at one of
- EOS (the end-of-turn token);
- the close tag `</tool_call>` of its `max_parallel_calls`-th call, so a turn holds at most that
  many calls (with one call per turn the tag is a stop token when the tokenizer encodes it as
  one id; else the tag is found in the decoded turn, which is cut right after it);
- the token budget: `max_new_tokens` counts every response token of the trajectory, generated
  or not.
A turn with calls has them parsed (`hfjax.tools.parse_tool_calls`) and handed to a `ToolRunner`,
which runs them in its thread pool; a turn without one ends the trajectory. The row leaves the
engine while its tools run: the loop keeps decoding the rows that are ready (their tools done,
or their first turn) and only waits for tools when no row is ready. When a row's tools are done
its **tool turn** is appended: the observations rendered as the chat template renders `tool`
messages (or, for a tokenizer without a template, `<tool_response>...</tool_response>` per
observation), each observation in its call's order and cut to `max_tool_response_len` tokens,
ending in `CUT_MARK` when cut; a tool turn that does not fit the budget is dropped and ends the
trajectory. Those tokens are context, not policy output: the response mask is 0 on them (module
`hfjax.workers.actor` keeps them out of log-probs, entropy, KL and the loss), the attention mask
1. The trajectory ends at a turn without calls, after `max_turns` policy turns, or when the
budget is spent.

Every row keeps its KV cache for the whole trajectory (`hfjax.engine.session`): the first turn
is the caller's request as it stands (its seeds, `n` samples per prompt, the single-turn
engine's prefill), so a trajectory without tool calls is exactly what the single-turn engine
samples; a later turn resumes the row's cache, prefilling only what it lacks (its turn's last
token, then the tool's result), and decodes on. Rows whose tools finish together resume in one
program; the others wait in their own rows of the session meanwhile. Each later turn has a seed
of its own (its prompt's seed, sample and turn), so a row's trajectory does not depend on which
other rows share its calls, and a turn draws what the engine draws when the row's whole context
is prefilled again with that seed (tests/engine/test_session.py).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import weakref
import zlib
from collections.abc import Sequence

import numpy as np
from absl import logging

from hfjax.agents.fit import check_spec
from hfjax.agents.render import CUT_MARK, close_tag_id, observation_renderer
from hfjax.agents.trajectory import AgentOutput, Trajectory
from hfjax.engine.sampler import Sampler
from hfjax.engine.session import TurnEngine, TurnSession
from hfjax.engine.spec import MultiTurnSpec
from hfjax.engine.token_select import SamplingParams
from hfjax.tools import Observation, ToolCall, parse_tool_calls
from hfjax.tools.parse import TOOL_CALL_CLOSE


def _turn_seed(seed: int, prompt: int, sample: int, turn: int) -> int:
    """A 31-bit seed of its own for turn `turn` of sample `sample` of a prompt."""
    return zlib.crc32(f"{seed}/{prompt}/{sample}/{turn}".encode()) & 0x7FFFFFFF


def _call_dict(c: ToolCall | Observation) -> dict | None:
    return {"name": c.name, "arguments": c.arguments} if isinstance(c, ToolCall) else None


class _Row:
    """A trajectory being built."""

    def __init__(self, prompt: list[int]):
        self.prompt = prompt
        self.tokens: list[int] = []
        self.gen: list[int] = []
        self.lps: list[float] = []
        self.traj = Trajectory()
        self.future: cf.Future | None = None
        self.calls: list = []
        self.done = False
        self.cached = 0  # response tokens whose keys and values the session's cache holds
        self.ended_eos = False  # the last policy turn ended at an EOS/end-of-turn token

    def add(self, tokens, gen: int, lps=None):
        self.tokens += [int(t) for t in tokens]
        self.gen += [gen] * len(tokens)
        self.lps += [float(x) for x in lps] if lps is not None else [0.0] * len(tokens)

    def finish(self, why: str):
        self.done, self.traj.stop = True, why


class AgentLoop:
    """Runs multi-turn rollouts with a sampler, a tokenizer and a tool runner (module
    docstring), as `spec` (`rollout.multi_turn`) says. `runner` is a `hfjax.tools.ToolRunner`
    (anything with `submit(calls) -> Future[list[Observation]]`). The loop owns the runner and
    closes it, unless `owns_runner=False` (a runner shared by several loops, closed by whoever
    made it)."""

    def __init__(self, sampler: Sampler, tokenizer, runner, spec: MultiTurnSpec, *,
                 owns_runner: bool = True):
        MultiTurnSpec.require(spec, "AgentLoop", "spec")
        check_spec(spec)
        self.sampler = sampler
        self.tok = tokenizer
        self.runner = runner
        # A loop dropped without close() still ends its tool workers when it is collected (the
        # runner's own threads keep the runner alive, so it cannot do this itself).
        self.owns_runner = owns_runner
        if owns_runner and hasattr(runner, "close"):
            weakref.finalize(self, runner.close)
        self.spec = spec
        self.render = observation_renderer(tokenizer)
        self.close_id = close_tag_id(tokenizer)
        self.mark_len = len(tokenizer.encode(CUT_MARK, add_special_tokens=False))
        if spec.max_tool_response_len <= self.mark_len:
            raise ValueError(f"rollout.multi_turn.max_tool_response_len="
                             f"{spec.max_tool_response_len} leaves no room for a cut result's "
                             f"mark {CUT_MARK!r} ({self.mark_len} tokens); set it above "
                             f"{self.mark_len}")
        self.pad_id = int(sampler.pad_id)
        self.engine = TurnEngine(sampler)
        self.turn_calls = 0  # session programs (first turn and resumes) of the last `run`
        self.prefilled = 0  # tokens the last `run`'s resumes prefilled


    def close(self) -> None:
        """Closes the tool runner (its threads end their worker processes)."""
        close = getattr(self.runner, "close", None) if self.owns_runner else None
        if close is not None:
            close()
    def _cut_at_close(self, tokens: np.ndarray, k: int) -> int | None:
        """The number of tokens up to and including the `k`-th close tag, or None."""
        if self.close_id is not None:
            hit = np.flatnonzero(tokens == self.close_id)
            return int(hit[k - 1]) + 1 if hit.size >= k else None
        if self._text(tokens).count(TOOL_CALL_CLOSE) < k:
            return None
        # The shortest prefix holding k tags, by bisection: a prefix's text is a prefix of the
        # whole text, so its tag count grows with its length. log2(n) decodes of at most n
        # tokens, where decoding every prefix in turn was quadratic in the turn's length.
        lo, hi = 0, len(tokens)  # the prefix of `lo` tokens holds fewer than k, `hi` at least k
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self._text(tokens[:mid]).count(TOOL_CALL_CLOSE) >= k:
                hi = mid
            else:
                lo = mid
        return hi

    def _text(self, tokens) -> str:
        return self.tok.decode([int(t) for t in tokens], skip_special_tokens=False)

    def _policy_turn(self, row: _Row, tokens: np.ndarray, lps: np.ndarray, eos: set[int],
                     budget: int) -> None:
        """Appends one decoded turn to `row` and decides what follows it."""
        room = budget - len(row.tokens)
        limit = self.spec.max_parallel_calls
        cut = self._cut_at_close(tokens, limit)
        if cut is not None and cut <= room:  # the limit's last call: nothing after it runs
            tokens, lps = tokens[:cut], lps[:cut]
        else:
            tokens, lps = tokens[:room], lps[:room]
        row.add(tokens, 1, lps)
        text = self._text(tokens)
        row.traj.turns.append({"role": "assistant", "text": text, "tokens": len(tokens)})
        row.ended_eos = bool(len(tokens)) and int(tokens[-1]) in eos
        if TOOL_CALL_CLOSE not in text:
            row.finish("eos" if row.ended_eos else "length")
        elif len(row.tokens) >= budget:
            row.finish("length")
        elif row.traj.num_turns >= self.spec.max_turns:
            row.finish("max_turns")
        else:
            calls = parse_tool_calls(text)
            if not calls:  # a close tag without an opening one: nothing to run
                calls = [Observation(f"Error: {TOOL_CALL_CLOSE} without <tool_call>", True)]
            # Cut at the limit's close tag, a turn holds at most `limit` calls; a parser that
            # reads more (a malformed block) gets them answered, not run.
            over = Observation(f"Error: more than max_parallel_calls={limit} calls in one "
                               "turn; this one was not run", True)
            row.calls = calls[:limit] + [over] * (len(calls) - limit)
            row.future = self.runner.submit(row.calls)

    def _observation(self, o: Observation) -> Observation:
        """`o` cut to max_tool_response_len tokens, ending in CUT_MARK when cut."""
        ids = self.tok.encode(o.text, add_special_tokens=False)
        cap = self.spec.max_tool_response_len
        if len(ids) <= cap:
            return o
        return Observation(self._text(ids[:cap - self.mark_len]) + CUT_MARK, o.error)

    def _tool_turn(self, row: _Row, budget: int) -> None:
        """Appends the observations of `row`'s finished tool calls, in the calls' order; a tool
        turn that does not fit what is left of the budget is dropped and ends the trajectory
        ("tool_length"): half a result would read as a whole one."""
        try:
            obs = list(row.future.result())
        except Exception as err:  # a runner that broke its promise never to raise
            obs = [Observation(f"Error: the tool runner failed: {err}", True)] * len(row.calls)
        row.future = None
        cut = [self._observation(o) for o in obs]
        ids = self.tok.encode(self.render(cut), add_special_tokens=False)
        if row.ended_eos and ids and ids[0] == row.tokens[-1]:
            # A turn that ran to its end-of-turn token already holds the one the template
            # writes after an assistant message (Qwen's <|im_end|>).
            ids = ids[1:]
        room = budget - len(row.tokens)
        if len(ids) > room:
            row.finish("tool_length")
            return
        row.add(ids, 0)
        row.traj.turns.append({
            "role": "tool", "calls": [_call_dict(c) for c in row.calls],
            "results": [{"text": o.text, "error": bool(o.error)} for o in cut],
            "tokens": len(ids)})
        if len(ids) >= room:
            row.finish("length")

    def run(self, state, input_ids, attention_mask, params: SamplingParams,
            seed: int | Sequence[int] | np.ndarray = 0) -> AgentOutput:
        """Multi-turn trajectories for left-padded prompts [B, P]: `params.n` per prompt,
        `params.max_new_tokens` response tokens each at most (generated and observed
        together). Returns host arrays (`AgentOutput`)."""
        ids = np.asarray(input_ids)
        mask = np.asarray(attention_mask) != 0
        batch, n, budget = ids.shape[0], params.n, params.max_new_tokens
        seeds = (np.full((batch,), int(seed)) if np.ndim(seed) == 0
                 else np.asarray(seed).reshape(-1))
        stops = set(params.eos_ids)
        # With one call per turn the close tag ends the turn on device; with more, the turn
        # decodes on and is cut at the limit's close tag afterwards (the tokens before the cut
        # are the same either way: a stop only ends a row).
        one_call = self.spec.max_parallel_calls == 1 and self.close_id is not None
        turn_stops = tuple(params.eos_ids) + ((self.close_id,) if one_call else ())
        rows = [_Row([int(t) for t in ids[b][mask[b]]]) for b in range(batch) for _ in range(n)]
        self.turn_calls = 0

        # First turn: the caller's request as it stands (n samples per prompt, its seeds).
        first = dataclasses.replace(params, eos_ids=turn_stops)
        session = self.engine.open(state, ids, mask.astype(np.int32), first, seed)
        self.turn_calls += 1
        self._read_turns(session, rows, range(len(rows)), stops, budget)

        while not all(row.done for row in rows):
            pending = [row.future for row in rows if row.future is not None]
            ready = [i for i, row in enumerate(rows)
                     if not row.done and row.future is not None and row.future.done()]
            if not ready:
                if not pending:  # cannot happen: a live row is decoding or waiting on tools
                    raise RuntimeError("multi-turn rollout: rows neither ready nor waiting")
                cf.wait(pending, return_when=cf.FIRST_COMPLETED)
                continue
            for i in ready:
                self._tool_turn(rows[i], budget)
            go = [i for i in ready if not rows[i].done]
            if go:
                # Each row's cache lacks its turn's last token and the tool's result: only
                # those are prefilled. Later turns are keyed per row (prompt seed, sample,
                # turn), so a trajectory does not depend on which rows share a call.
                session.resume(
                    {i: (rows[i].cached, rows[i].tokens[rows[i].cached:]) for i in go},
                    {i: _turn_seed(int(seeds[i // n]), i // n, i % n, rows[i].traj.num_turns)
                     for i in go})
                self.turn_calls += 1
                self._read_turns(session, rows, go, stops, budget)
        self.prefilled = session.prefilled
        return self._assemble(rows, budget)

    def _read_turns(self, session: TurnSession, rows: list[_Row], which, eos: set[int],
                    budget: int) -> None:
        """Appends the turn the session just decoded to each of rows `which`."""
        toks, lps, start, t = session.turns()
        for i in which:
            a, b = int(start[i]), int(t[i])
            self._policy_turn(rows[i], toks[i, a:b], lps[i, a:b], eos, budget)
            # The turn's last kept token was drawn but never fed: its key and value are not
            # in the cache (nor, where the turn was cut short, those of the tokens after it).
            rows[i].cached = len(rows[i].tokens) - 1

    def _assemble(self, rows: list[_Row], budget: int) -> AgentOutput:
        shape = (len(rows), budget)
        tokens = np.full(shape, self.pad_id, np.int32)
        gen = np.zeros(shape, np.int32)
        attn = np.zeros(shape, np.int32)
        lps = np.zeros(shape, np.float32)
        for r, row in enumerate(rows):
            k = len(row.tokens)
            tokens[r, :k], gen[r, :k], attn[r, :k], lps[r, :k] = row.tokens, row.gen, 1, row.lps
        trajs = [row.traj for row in rows]
        logging.log_every_n(logging.INFO, "hfjax.engine: %d trajectories, %d turn programs, "
                            "%.2f turns and %.2f tool calls per trajectory", 10, len(rows),
                            self.turn_calls, np.mean([t.num_turns for t in trajs]),
                            np.mean([t.tool_calls for t in trajs]))
        return AgentOutput(tokens, gen, attn, lps, trajs)



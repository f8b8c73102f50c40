"""Partial rollouts: rows interrupted by a weight push continue under the new weights.

A batch decoded under policy version v may be cut at response column `at` (where a push of a
newer version v' lands). A row that has already drawn a stop token is finished: it keeps its
tokens, all of version v. A row still decoding keeps its prefix (tokens, per-token log-probs
and versions) and continues under v' from where it stopped. Its KV cache was computed under v,
so it is not reused: the row's whole context, prompt then prefix, is prefilled again under v'
(the cache recomputed), and decoding goes on from the last prefix position, response token j
at position prompt length + j as in an uninterrupted decode. This is the re-prefill that
`hfjax.engine.session` is checked against (a turn equals the static engine's draw over the
row's context so far): the same left-padded context through the same `Sampler`.

Seeds: the continuation keys row r with `seeds[r]` as the static engine keys a one-sample
prompt, token k of the continuation folding in k. A row that was not interrupted is not
recomputed.

The asynchronous loop uses it with `async_rollout.partial_rollout=True`
(`hfjax.workers.rollout.generate_partial`, scheduled by `hfjax.run.async_loop.switch_of`).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np
from flax import nnx

from hfjax.engine.sampler import Sampler
from hfjax.engine.token_select import SamplingParams
from hfjax.parallel.transfer import host_values


class PartialRows(NamedTuple):
    """Host arrays [rows, budget]: a batch's responses with the version of every token."""

    tokens: np.ndarray  # int32, pad after a row's end
    mask: np.ndarray  # int32, 1 on real response tokens (stop token included)
    logprobs: np.ndarray  # float32, 0 where mask is 0
    versions: np.ndarray  # int32, the policy version that drew each token (-1 where mask is 0)


def cut(out, at: int, version: int, eos_ids: tuple[int, ...]) -> tuple[PartialRows, np.ndarray]:
    """(the first `at` response columns of a generate output `out` drawn under `version`, the
    rows still decoding there [rows] bool). A row is still decoding when it has `at` real
    tokens and none of them is a stop token."""
    tokens, mask, lps = (np.asarray(x)[:, :at] for x in _fetch(out))
    stopped = np.any(np.isin(tokens, np.asarray(eos_ids)) & (mask > 0), axis=1)
    live = (mask.sum(axis=1) == at) & ~stopped
    versions = np.where(mask > 0, version, -1).astype(np.int32)
    return PartialRows(tokens.astype(np.int32), mask.astype(np.int32),
                       lps.astype(np.float32), versions), live


def continue_rows(sampler: Sampler, state: nnx.State, prompt_ids, prompt_mask, n: int,
                  rows: PartialRows, live: np.ndarray, version: int, params: SamplingParams,
                  seeds) -> PartialRows:
    """`rows` (sample j of prompt b at row b * n + j, prompts left-padded) with every `live`
    row continued under `state` (policy `version`) up to `params.max_new_tokens` response
    tokens in all; its new tokens carry `version`. Rows not live are returned as they are.
    `seeds[r]` keys row r's continuation. The sampler's `max_prompt_len` must hold a prompt
    and its longest prefix."""
    budget = params.max_new_tokens
    prompt_ids, prompt_mask = np.asarray(prompt_ids), np.asarray(prompt_mask)
    have = rows.mask.sum(axis=1)
    width = rows.tokens.shape[1]
    if width > budget:
        raise ValueError(f"a prefix of {width} columns exceeds max_new_tokens={budget}")
    out = PartialRows(*(np.pad(x, ((0, 0), (0, budget - width)), constant_values=fill)
                        for x, fill in zip(rows, (sampler.pad_id or 0, 0, 0.0, -1))))
    go = [r for r in np.flatnonzero(live) if have[r] < budget]
    if not go:
        return out
    contexts = [list(prompt_ids[r // n][prompt_mask[r // n] > 0]) + list(rows.tokens[r, :have[r]])
                for r in go]
    longest = max(map(len, contexts))
    if longest > sampler.max_prompt_len:
        raise ValueError(f"a prompt and its prefix take {longest} tokens but the sampler's "
                         f"max_prompt_len is {sampler.max_prompt_len}; build it with "
                         "max_prompt_len >= prompt length + response budget")
    # Left-padded here (hfjax.data imports the engine, not the other way round).
    ids = np.full((len(go), longest), sampler.pad_id or 0, np.int32)
    mask = np.zeros((len(go), longest), np.int32)
    for k, c in enumerate(contexts):
        ids[k, longest - len(c):], mask[k, longest - len(c):] = c, 1
    rest = int(budget - min(have[r] for r in go))
    more = sampler.generate(state, ids, mask,
                            dataclasses.replace(params, max_new_tokens=rest, n=1),
                            seed=np.asarray([seeds[r] for r in go], np.uint32))
    tok, msk, lp = _fetch(more)
    for k, r in enumerate(go):
        room = int(budget - have[r])
        m = msk[k, :room] > 0
        span = slice(int(have[r]), int(have[r]) + room)
        out.tokens[r, span] = np.where(m, tok[k, :room], out.tokens[r, span])
        out.mask[r, span] = m
        out.logprobs[r, span] = np.where(m, lp[k, :room], 0.0)
        out.versions[r, span] = np.where(m, version, -1)
    return out



def _fetch(out) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A generate output's tokens, mask and log-probs on the host of every process, also one
    that holds none of the rollout pool's devices (`host_values`: across processes they come
    through the key-value store)."""
    got = host_values({"tokens": out.tokens, "mask": out.mask, "logprobs": out.logprobs})
    return tuple(np.asarray(got[k]) for k in ("tokens", "mask", "logprobs"))

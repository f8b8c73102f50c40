"""Rule rewards as a role of the dataflow: rule functions chosen by data_source, run on the host.

Rule rewards need text, so their protocol is ON_HOST: the response tokens come to the host (the
step's one deliberate fetch), are decoded and scored there, and the scores go back to the
dataflow's mesh as `token_level_scores` [B, R], each sequence's score on its last response
token.

When a run also has a reward model or a generative judge, the scores are combined per
data_source: each source has a rule, a model and a judge weight (`reward.rule_weight`,
`reward.model_weight`, `reward.judge_weight`, and per-source overrides in `reward.sources`, see
`parse_source_weights`); `RuleReward.source_weights` gives every row its weights.
"""

from __future__ import annotations

import numpy as np
from absl import logging
from jax.sharding import Mesh

from hfjax.controller.batch import Batch
from hfjax.controller.protocol import ON_HOST, method
from hfjax.rewards.custom import load_custom_reward
from hfjax.rewards.pool import ERROR, OK, TIMEOUT, RewardPool, shared_pool
from hfjax.rewards.registry import get_reward_fn


def scores_at_last_token(scores: np.ndarray, response_mask: np.ndarray) -> np.ndarray:
    """[B] scores -> [B, R] float32 with each score on the row's last response (policy) token
    (0 elsewhere, and everywhere in an empty row). The last policy token, not column
    sum(mask) - 1: a multi-turn row's mask has gaps where tool results sit."""
    mask = np.asarray(response_mask) > 0
    out = np.zeros(mask.shape, np.float32)
    rows = np.flatnonzero(mask.any(axis=1))
    last = mask.shape[1] - 1 - np.argmax(mask[:, ::-1], axis=1)
    out[rows, last[rows]] = np.asarray(scores, np.float32)[rows]
    return out


class RuleReward:
    """Scores decoded responses with the rule reward for each row, in a host worker pool.

    Each row's function comes from its `data_source` (or `reward_style`, or `custom_fn`; see
    `hfjax.rewards.registry`). Calls run in `num_processes` subprocesses with a `timeout_s`
    limit per call (`hfjax.rewards.pool`): a function that raises or hangs scores 0 and is
    counted in `failures` / `timeouts`, never ending the run. A data_source with no reward is a
    configuration error and raises. Scores come back on `home`, the dataflow's mesh (None: as
    host arrays).

    Batch meta read: `data_source`, `ground_truth`, and optionally `reward_style` and
    `extra_info` (per-row dicts; reasoning-gym rows need theirs).
    """

    def __init__(
        self,
        tokenizer,
        *,
        custom_fn: str | None = None,
        num_processes: int = 2,
        timeout_s: float = 10.0,
        pool: RewardPool | None = None,
        home: Mesh | None = None,
        rule_weight: float = 1.0,
        model_weight: float = 1.0,
        judge_weight: float = 1.0,
        sources: dict[str, tuple[float, float, float]] | None = None,
    ):
        self.tokenizer = tokenizer
        self.mesh = None  # computes on the host
        self.home = home
        self.custom_fn = custom_fn or None
        self.pool = pool if pool is not None else shared_pool(num_processes, timeout_s)
        self.default_weights = (float(rule_weight), float(model_weight), float(judge_weight))
        self.sources = dict(sources or {})
        if self.custom_fn:
            # A bad spec, or a file that fails or hangs while importing, fails here, before any
            # work: the scorer processes import it under the timeout (the controller never
            # does, unless it scores in-process).
            fn = get_reward_fn("", custom_fn=self.custom_fn)
            if self.pool.num_processes:
                self.pool.preload(fn)
            else:
                load_custom_reward(self.custom_fn)
        self.failures = 0
        self.timeouts = 0
        self._since_pop = {"reward/failures": 0, "reward/timeouts": 0}

    def score_texts(
        self,
        texts: list[str],
        sources: list[str],
        truths: list[str],
        extra_infos: list[dict | None] | None = None,
        styles: list[str | None] | None = None,
    ) -> tuple[np.ndarray, dict[str, int]]:
        """[B] float32 scores for decoded responses, and this call's failure/timeout counts."""
        n = len(texts)
        extra_infos = list(extra_infos) if extra_infos is not None else [None] * n
        styles = list(styles) if styles is not None else [None] * n
        resolved: dict[tuple, object] = {}
        fns = []
        for i in range(n):
            key = (str(sources[i]), _opt_str(styles[i]))
            if key not in resolved:
                resolved[key] = get_reward_fn(*key, self.custom_fn)
            fns.append(resolved[key])
        args = [
            (str(sources[i]), texts[i], str(truths[i]), _plain(extra_infos[i])) for i in range(n)
        ]
        outcomes = self.pool.map(fns, args)
        scores = np.array([o.score for o in outcomes], np.float32)
        bad = [(i, o) for i, o in enumerate(outcomes) if o.status != OK]
        counts = {
            "reward/failures": sum(o.status == ERROR for _, o in bad),
            "reward/timeouts": sum(o.status == TIMEOUT for _, o in bad),
        }
        for i, o in bad[:_LOGGED_PER_BATCH]:
            logging.warning("reward for row %d (data_source %s) %s: %s; scoring it 0",
                            i, sources[i], "timed out" if o.status == TIMEOUT else "failed",
                            o.error)
        if len(bad) > _LOGGED_PER_BATCH:
            logging.warning("%d more reward calls in this batch failed or timed out; scored 0",
                            len(bad) - _LOGGED_PER_BATCH)
        self.failures += counts["reward/failures"]
        self.timeouts += counts["reward/timeouts"]
        for k, v in counts.items():
            self._since_pop[k] += v
        return scores, counts

    def close(self) -> None:
        """Stops the scorer processes of its pool (a later call starts fresh ones)."""
        self.pool.close()

    @method(ON_HOST, reads=("responses", "response_mask"))
    def compute_reward(self, batch: Batch) -> Batch:
        """Batch with `token_level_scores` [B, R], the decoded `response_text` in meta, and
        this batch's `reward/failures` and `reward/timeouts` counts in info."""
        tokens, mask = batch["responses"], batch["response_mask"]
        texts = [
            self.tokenizer.decode(tokens[i][mask[i] > 0].tolist()) for i in range(len(tokens))
        ]
        meta = batch.meta
        infos = list(meta["extra_info"]) if "extra_info" in meta else None
        if "trajectory" in meta:
            # Multi-turn rows: the reward may read the whole trajectory (turns, tool calls,
            # results) as extra_info["trajectory"]; the text scored is the policy's own turns.
            infos = [{**(_plain(e) or {}), "trajectory": t}
                     for e, t in zip(infos or [None] * len(texts), meta["trajectory"])]
        scores, counts = self.score_texts(
            texts,
            list(meta["data_source"]),
            list(meta["ground_truth"]),
            infos,
            list(meta["reward_style"]) if "reward_style" in meta else None,
        )
        return Batch({"token_level_scores": scores_at_last_token(scores, mask)},
                     meta={"response_text": texts}, info=counts)

    def weights_for(self, source: str) -> tuple[float, float, float]:
        """(rule weight, model weight, judge weight) of a data_source."""
        return self.sources.get(str(source), self.default_weights)

    def needs_rules(self, sources) -> bool:
        """Whether any of these data_sources gives its rule reward a non-zero weight (a run
        whose rewards all come from a model skips the host scoring)."""
        return any(self.weights_for(s)[0] != 0.0 for s in sources)

    @method(ON_HOST, reads=())
    def source_weights(self, batch: Batch) -> Batch:
        """Batch with `rule_weight`, `model_weight` and `judge_weight` [B] (float32), each
        row's by its data_source, placed on `home` like any host result."""
        w = np.array([self.weights_for(s) for s in batch.meta["data_source"]], np.float32)
        return Batch({f"{kind}_weight": w[:, i].copy() for i, kind in enumerate(WEIGHT_KINDS)})

    def pop_metrics(self) -> dict[str, float]:
        """`reward/failures` and `reward/timeouts` since the previous call, for step metrics."""
        out = {k: float(v) for k, v in self._since_pop.items()}
        self._since_pop = dict.fromkeys(self._since_pop, 0)
        return out


_LOGGED_PER_BATCH = 5


def _opt_str(x) -> str | None:
    return None if x is None else str(x)


def _plain(info):
    """extra_info as plain JSON-able Python values (parquet and Batch meta may hold numpy)."""
    if info is None:
        return None
    if isinstance(info, dict):
        return {str(k): _plain(v) for k, v in info.items()}
    if isinstance(info, (list, tuple, np.ndarray)):
        return [_plain(v) for v in info]
    if isinstance(info, np.generic):
        return info.item()
    return info


# The scores a reward stage combines, in the order of a source's weights.
WEIGHT_KINDS = ("rule", "model", "judge")


def parse_source_weights(text: str) -> dict[str, tuple[float, float, float]]:
    """{data_source: (rule weight, model weight, judge weight)} from `reward.sources`, written
    "source=rule:W,model:W,judge:W;other=model:W" (a weight left out is 0 for that source),
    e.g. "hfjax/arith=rule:1,model:0.5"; ValueError naming the bad item."""
    out: dict[str, tuple[float, float, float]] = {}
    for item in filter(None, (x.strip() for x in str(text or "").split(";"))):
        source, sep, rest = item.rpartition("=")
        weights = dict.fromkeys(WEIGHT_KINDS, 0.0)
        try:
            if not sep or not source.strip():
                raise ValueError
            for part in rest.split(","):
                kind, _, value = part.partition(":")
                if kind.strip() not in weights:
                    raise ValueError
                weights[kind.strip()] = float(value)
        except ValueError:
            raise ValueError(
                f"reward.sources item {item!r}: write data_source=rule:W,model:W,judge:W (e.g. "
                "'hfjax/arith=rule:1,model:0.5'), items separated by ';'") from None
        out[source.strip()] = tuple(weights[k] for k in WEIGHT_KINDS)
    return out

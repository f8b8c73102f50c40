"""Prompt datasets in verl's schema: loading, validation, tokenization, filtering, iteration.

A row is
    data_source   str                  picks the reward (see hfjax.rewards.registry)
    prompt        [{role, content}]    chat messages
    ability       str, optional
    reward_model  {style, ground_truth: str}
    extra_info    dict, optional       passed to the reward (reasoning-gym keeps its entry here)
    agent_name    str, optional        verl's multi-turn field: the agent loop for the row
and, inside extra_info, verl's multi-turn fields
    tools_kwargs        {tool name: {create_kwargs, ...}}, optional: per-row tool settings
    interaction_kwargs  dict, optional: per-row settings of the environment (name, query, ...)

A dataset where any row has a multi-turn field gives every row all three (defaults
"single_turn_agent", {} and {}, as verl's reader does), and `reward_meta` passes them to the
batch's non-tensor data as `agent_name`, `tools_kwargs` and `interaction_kwargs`. A tool a row
does not name reads back from parquet as a null entry (parquet unifies struct fields across
rows), which is dropped.

Every row is checked when the dataset is built, before anything compiles:
- a missing field or a value of the wrong type is an error naming the file, the row and the
  field (`on_bad_row="skip"` makes these counted skips instead);
- a data_source with no reward is an error naming it and the known ones;
- with `images=True` (a vision-language policy), verl's multimodal column `images` (a list of
  {"bytes": ...} records, one `<image>` placeholder each in the messages) is checked: an image
  that does not decode, has no pixels, or exceeds `max_image_pixels`, and a placeholder count
  that differs from the image count, are errors naming the row (counted skips with
  `on_bad_row="skip"`); rows keep the images' bytes in `images`. Without it, a row with
  images is refused: the policy is text-only;
- an empty prompt, a ground truth the row's reward could never match (see each reward's check),
  and a prompt longer than `max_prompt_length` tokens are counted skips, logged as warnings and
  listed in `Dataset.report`.

Prompts are tokenized once, with the chat template when the tokenizer has one and otherwise
as the last message's text (`render_prompt`). Kept rows carry their ids in `prompt_ids`.

`PromptIterator` deals batches in a seeded shuffled order, epoch after epoch. Its position is a
small dict (`state()` / `restore()`), so a resumed run draws exactly the batches the
uninterrupted run would have drawn.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow.parquet as pq
from absl import logging

from hfjax.data import arith, holdout, shapes, tool_arith
from hfjax.data import images as image_lib
from hfjax.rewards.registry import check_ground_truth, resolve_reward

REQUIRED_COLUMNS = ("data_source", "prompt", "reward_model")

# Skip reasons, as they appear in LoadReport.skipped.
EMPTY_PROMPT = "empty prompt"
BAD_GROUND_TRUTH = "ground truth the reward cannot score"
TOO_LONG = "prompt longer than max_prompt_length"
MALFORMED = "malformed row"
BAD_IMAGE = "bad image"

_LOGGED_SKIPS = 5


class RowError(ValueError):
    """A row that breaks the schema; the message names the file, the row and the field."""


@dataclass
class LoadReport:
    """What building a Dataset read, kept and skipped (reason -> count)."""

    source: str
    rows_read: int = 0
    rows_kept: int = 0
    skipped: dict[str, int] = field(default_factory=dict)

    @property
    def too_long(self) -> int:
        """Rows dropped for a prompt longer than max_prompt_length."""
        return self.skipped.get(TOO_LONG, 0)

    def summary(self) -> str:
        """One line: rows read, kept, and skipped by reason."""
        skips = ", ".join(f"{n} {why}" for why, n in sorted(self.skipped.items())) or "none"
        return (f"{self.source}: read {self.rows_read} rows, kept {self.rows_kept}; "
                f"skipped: {skips}")


def render_prompt(tok, messages: Sequence[dict]) -> list[int]:
    """Prompt ids: the chat template when the tokenizer has one, else the last message text."""
    if getattr(tok, "chat_template", None):
        return tok.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
    return tok.encode(messages[-1]["content"], add_special_tokens=False)


MULTI_TURN_FIELDS = ("agent_name", "tools_kwargs", "interaction_kwargs")
DEFAULT_AGENT = "single_turn_agent"


def reward_meta(rows: Sequence[dict]) -> dict[str, list]:
    """The per-row Batch meta RuleReward reads: data_source, ground_truth, reward_style,
    extra_info; plus agent_name, tools_kwargs and interaction_kwargs when the rows carry
    verl's multi-turn fields (the agent loop reads them)."""
    meta = {
        "data_source": [r["data_source"] for r in rows],
        "ground_truth": [r["reward_model"]["ground_truth"] for r in rows],
        "reward_style": [r["reward_model"].get("style") for r in rows],
        "extra_info": [r.get("extra_info") for r in rows],
    }
    if any(r.get(k) is not None for r in rows for k in MULTI_TURN_FIELDS):
        meta["agent_name"] = [r.get("agent_name") or DEFAULT_AGENT for r in rows]
        meta["tools_kwargs"] = [r.get("tools_kwargs") or {} for r in rows]
        meta["interaction_kwargs"] = [r.get("interaction_kwargs") or {} for r in rows]
    return meta


# -- validation ----------------------------------------------------------------------------------


def _typename(x: Any) -> str:
    return "null" if x is None else type(x).__name__


def _need(row: dict, key: str, kind: type | tuple, where: str, what: str,
          want: str | None = None) -> Any:
    if key not in row or row[key] is None:
        raise RowError(f"{where}: missing field {what}")
    value = row[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        want = want or getattr(kind, "__name__", str(kind))
        raise RowError(f"{where}: field {what} is {_typename(value)}, expected {want}")
    return value


def normalize_row(row: Any, where: str) -> dict:
    """The row with its schema checked and optional fields filled; RowError otherwise."""
    if not isinstance(row, dict):
        raise RowError(f"{where}: is {_typename(row)}, expected a dict in verl's schema")
    source = _need(row, "data_source", str, where, "data_source")
    prompt = _need(row, "prompt", (list, tuple, np.ndarray), where, "prompt",
                   "a list of {role, content} messages")
    messages = []
    for j, msg in enumerate(prompt):
        if not isinstance(msg, dict):
            raise RowError(f"{where}: field prompt[{j}] is {_typename(msg)}, expected "
                           "{role, content}")
        role = _need(msg, "role", str, where, f"prompt[{j}].role")
        content = _need(msg, "content", str, where, f"prompt[{j}].content")
        messages.append({"role": role, "content": content})
    rm = _need(row, "reward_model", dict, where, "reward_model", "{style, ground_truth}")
    truth = _need(rm, "ground_truth", str, where, "reward_model.ground_truth")
    style = rm.get("style")
    if style is not None and not isinstance(style, str):
        raise RowError(f"{where}: field reward_model.style is {_typename(style)}, expected str")
    ability = row.get("ability")
    if ability is not None and not isinstance(ability, str):
        raise RowError(f"{where}: field ability is {_typename(ability)}, expected str")
    extra = row.get("extra_info")
    if extra is not None and not isinstance(extra, dict):
        raise RowError(f"{where}: field extra_info is {_typename(extra)}, expected a dict")
    agent = row.get("agent_name")
    if agent is not None and (not isinstance(agent, str) or not agent):
        raise RowError(f"{where}: field agent_name is {_typename(agent)}, expected a non-empty "
                       "str such as 'tool_agent'")
    return {
        "data_source": source,
        "prompt": messages,
        "ability": ability,
        "reward_model": {"style": style, "ground_truth": truth},
        "extra_info": extra,
        "agent_name": agent,
        **_multi_turn_kwargs(extra, where),
    }


def _multi_turn_kwargs(extra: dict | None, where: str) -> dict:
    """extra_info's tools_kwargs and interaction_kwargs, checked (None when absent)."""
    extra = extra or {}
    tools = extra.get("tools_kwargs")
    if tools is not None:
        if not isinstance(tools, dict):
            raise RowError(f"{where}: field extra_info.tools_kwargs is {_typename(tools)}, "
                           "expected a dict {tool name: {create_kwargs: {...}}}")
        # A null entry is a tool another row names (parquet's struct fields are shared).
        tools = {name: kw for name, kw in tools.items() if kw is not None}
        for name, kw in tools.items():
            if not isinstance(kw, dict):
                raise RowError(f"{where}: field extra_info.tools_kwargs.{name} is "
                               f"{_typename(kw)}, expected a dict such as "
                               "{create_kwargs: {...}}")
    interaction = extra.get("interaction_kwargs")
    if interaction is not None and not isinstance(interaction, dict):
        raise RowError(f"{where}: field extra_info.interaction_kwargs is "
                       f"{_typename(interaction)}, expected a dict")
    return {"tools_kwargs": tools, "interaction_kwargs": interaction}


def _empty(messages: list[dict]) -> bool:
    return not messages or not messages[-1]["content"].strip()


# -- the dataset ---------------------------------------------------------------------------------


class Dataset:
    """Validated, tokenized prompt rows (see the module docstring).

    `rows[i]` is the normalized verl row plus `prompt_ids` (list[int]); `report` says what was
    read, kept and skipped. Raises ValueError for schema errors, an unknown data_source, or
    when no row survives.
    """

    def __init__(
        self,
        rows: Sequence[dict],
        tokenizer,
        max_prompt_length: int,
        *,
        name: str = "rows",
        custom_reward_fn: str | None = None,
        on_bad_row: str = "error",
        row_labels: Sequence[str] | None = None,
        images: bool = False,
        max_image_pixels: int = image_lib.MAX_DECODED_PIXELS,
    ):
        if on_bad_row not in ("error", "skip"):
            raise ValueError(f"on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")
        if max_prompt_length <= 0:
            raise ValueError(f"max_prompt_length must be positive, got {max_prompt_length}")
        self.name = name
        self.max_prompt_length = int(max_prompt_length)
        self.report = LoadReport(name, rows_read=len(rows))
        skips: list[tuple[str, str]] = []  # (reason, message)
        labels = row_labels or [f"{name} row {i}" for i in range(len(rows))]

        kept: list[dict] = []
        rewards_seen: dict[tuple[str, str | None], str] = {}
        for label, raw in zip(labels, rows):
            try:
                row = normalize_row(raw, label)
            except RowError as err:
                if on_bad_row == "error":
                    raise
                skips.append((MALFORMED, str(err)))
                continue
            pictures = raw.get("images")
            if pictures is not None and len(pictures) and not images:
                raise ValueError(f"{label} has images, but the policy is text-only; train a "
                                 "vision-language model or drop the images column")
            if images:
                try:
                    row["images"] = image_lib.row_images(pictures, row["prompt"],
                                                         max_image_pixels)
                except ValueError as err:
                    if on_bad_row == "error":
                        raise RowError(f"{label}: {err}") from None
                    skips.append((BAD_IMAGE, f"{label}: {err}"))
                    continue
            if _empty(row["prompt"]):
                skips.append((EMPTY_PROMPT, f"{label}: empty prompt"))
                continue
            rm = row["reward_model"]
            key = (row["data_source"], rm["style"])
            if key not in rewards_seen:
                try:
                    resolve_reward(row["data_source"], rm["style"], custom_reward_fn)
                except ValueError as err:
                    raise ValueError(f"{label}: {err}") from err
                rewards_seen[key] = label
            problem = check_ground_truth(row["data_source"], rm["ground_truth"],
                                         row["extra_info"], rm["style"], custom_reward_fn)
            if problem:
                skips.append((BAD_GROUND_TRUTH, f"{label}: {problem}"))
                continue
            kept.append(row)

        if any(row[k] is not None for row in kept for k in MULTI_TURN_FIELDS):
            # verl's defaults, so every row (and batch) of a multi-turn set has all three.
            for row in kept:
                row["agent_name"] = row["agent_name"] or DEFAULT_AGENT
                row["tools_kwargs"] = row["tools_kwargs"] or {}
                row["interaction_kwargs"] = row["interaction_kwargs"] or {}
        ids = _tokenize(tokenizer, [r["prompt"] for r in kept])
        self.rows: list[dict] = []
        too_long = 0
        for row, row_ids in zip(kept, ids):
            if len(row_ids) > self.max_prompt_length:
                too_long += 1
                continue
            row["prompt_ids"] = row_ids
            self.rows.append(row)

        for reason, _ in skips:
            self.report.skipped[reason] = self.report.skipped.get(reason, 0) + 1
        if too_long:
            self.report.skipped[TOO_LONG] = too_long
            logging.warning("%s: dropped %d of %d prompts longer than max_prompt_length=%d tokens",
                            name, too_long, len(kept), self.max_prompt_length)
        for _, message in skips[:_LOGGED_SKIPS]:
            logging.warning("skipping %s", message)
        if len(skips) > _LOGGED_SKIPS:
            logging.warning("%s: %d more rows skipped", name, len(skips) - _LOGGED_SKIPS)
        self.report.rows_kept = len(self.rows)
        logging.info("%s", self.report.summary())
        if not self.rows:
            raise ValueError(f"no usable rows: {self.report.summary()}")
        self.fingerprint = _fingerprint(self.rows)

    # -- constructors --------------------------------------------------------------------------

    @classmethod
    def from_parquet(
        cls, files: str | os.PathLike | Sequence[str | os.PathLike], tokenizer,
        max_prompt_length: int, **kw,
    ) -> Dataset:
        """Rows from one or more parquet files in verl's schema, in file order."""
        paths = [files] if isinstance(files, (str, os.PathLike)) else list(files)
        if not paths:
            raise ValueError("no parquet files given")
        rows, labels = [], []
        for path in paths:
            path = os.fspath(path)
            table = _read_table(path)
            rows.extend(table.to_pylist())
            labels.extend(f"parquet {path} row {i}" for i in range(table.num_rows))
        name = ", ".join(os.path.basename(os.fspath(p)) for p in paths)
        return cls(rows, tokenizer, max_prompt_length, name=name, row_labels=labels, **kw)

    @classmethod
    def arith(
        cls, n: int, seed: int, max_prompt_length: int, tokenizer=None, max_b: int = 99,
        split: str | None = None, **kw
    ) -> Dataset:
        """The embedded arithmetic task (hfjax.data.arith), generated in memory from `split`'s
        side of the held-out partition (None: the whole space)."""
        tok = tokenizer if tokenizer is not None else arith.tokenizer()
        return cls(arith.problems(n, seed=seed, max_b=max_b, split=split), tok,
                   max_prompt_length, name=f"arith {split or ''}".strip(), **kw)

    # -- access --------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]

    def iterator(self, batch_size: int, seed: int, shuffle: bool = True) -> PromptIterator:
        """A stateful, seeded iterator over batches of rows (see PromptIterator)."""
        return PromptIterator(self, batch_size, seed, shuffle)


def _read_table(path: str):
    if not os.path.isfile(path):
        raise ValueError(f"parquet file {path} does not exist")
    try:
        table = pq.read_table(path)
    except Exception as err:
        raise ValueError(f"cannot read parquet file {path}: {err}") from err
    missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
    if missing:
        raise ValueError(
            f"parquet {path}: missing column(s) {', '.join(missing)}; verl's schema has "
            "data_source, prompt, ability, reward_model{style, ground_truth}, extra_info "
            f"(found: {', '.join(table.column_names)})"
        )
    return table


def _tokenize(tok, prompts: list[list[dict]]) -> list[list[int]]:
    if getattr(tok, "chat_template", None):
        texts = [tok.apply_chat_template(p, add_generation_prompt=True) for p in prompts]
    else:
        texts = [p[-1]["content"] for p in prompts]
    if hasattr(tok, "batch_encode"):
        return tok.batch_encode(texts, add_special_tokens=False)
    return [tok.encode(t, add_special_tokens=False) for t in texts]


def _fingerprint(rows: list[dict]) -> int:
    """A checksum of the kept rows' prompt ids, images, rewards and order, to spot changed
    data."""
    crc = 0
    for r in rows:
        crc = zlib.crc32(np.asarray(r["prompt_ids"], np.int64).tobytes(), crc)
        for picture in r.get("images") or ():
            crc = zlib.crc32(picture, crc)
        tag = json.dumps([r["data_source"], r["reward_model"]["ground_truth"]])
        crc = zlib.crc32(tag.encode(), crc)
    return crc


# -- iteration -----------------------------------------------------------------------------------


class PromptIterator:
    """Batches of `batch_size` rows, shuffled per epoch from (seed, epoch); endless.

    An epoch's order depends only on the seed and the epoch number, so the position
    `{seed, epoch, cursor}` (plus the dataset's size and fingerprint, to catch changed data) is
    all a checkpoint needs. A batch never spans two epochs: rows left over at an epoch's end
    (fewer than batch_size) are skipped that epoch, as with verl's drop_last.
    """

    def __init__(self, dataset: Dataset, batch_size: int, seed: int, shuffle: bool = True):
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if batch_size > len(dataset):
            raise ValueError(f"batch_size {batch_size} is larger than the dataset "
                             f"({len(dataset)} rows after filtering: {dataset.report.summary()})")
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = int(seed)
        self.shuffle = shuffle
        self.epoch = 0
        self.cursor = 0
        self._order_epoch = -1
        self._order = np.arange(0)

    @property
    def steps_per_epoch(self) -> int:
        """Whole batches per epoch."""
        return len(self.dataset) // self.batch_size

    def _order_for(self, epoch: int) -> np.ndarray:
        if epoch != self._order_epoch:
            n = len(self.dataset)
            if self.shuffle:
                self._order = np.random.default_rng([self.seed, epoch]).permutation(n)
            else:
                self._order = np.arange(n)
            self._order_epoch = epoch
        return self._order

    def __iter__(self) -> PromptIterator:
        return self

    def __next__(self) -> list[dict]:
        if self.cursor + self.batch_size > len(self.dataset):
            self.epoch += 1
            self.cursor = 0
        idx = self._order_for(self.epoch)[self.cursor : self.cursor + self.batch_size]
        self.cursor += self.batch_size
        return [self.dataset.rows[i] for i in idx]

    def state(self) -> dict[str, int]:
        """The position, as plain ints: seed, epoch, cursor, num_rows, fingerprint."""
        return {
            "seed": self.seed,
            "epoch": self.epoch,
            "cursor": self.cursor,
            "num_rows": len(self.dataset),
            "fingerprint": int(self.dataset.fingerprint),
        }

    def restore(self, state: dict) -> None:
        """Continue from a `state()`; ValueError when it was saved for different data."""
        want = {"seed", "epoch", "cursor", "num_rows"}
        missing = want - set(state)
        if missing:
            raise ValueError(f"iterator state lacks {sorted(missing)}: {state}")
        n, fp = int(state["num_rows"]), state.get("fingerprint")
        if n != len(self.dataset) or (fp is not None and int(fp) != self.dataset.fingerprint):
            raise ValueError(
                f"iterator state was saved for {n} rows (fingerprint {fp}) but {self.dataset.name}"
                f" has {len(self.dataset)} rows (fingerprint {self.dataset.fingerprint}); resume "
                "with the same data files, tokenizer and max_prompt_length"
            )
        if int(state["seed"]) != self.seed:
            logging.warning("data iterator: resuming with the saved seed %d, not %d",
                            int(state["seed"]), self.seed)
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.cursor = int(state["cursor"])
        self._order_epoch = -1



def task_dataset(cfg, tokenizer, split: str) -> Dataset:
    """A run config's prompts for `split`, "train" or "test": the embedded tasks' (seeds `seed`
    and `seed + 10000`, each from its side of the held-out partition, hfjax.data.holdout), or
    `data.train_files` / `data.val_files`, checked against `reward.custom_fn` when one is set."""
    c, d = cfg, cfg.data
    train = split == "train"
    n, seed = (d.n_train, c.seed) if train else (d.n_test, c.seed + 10_000)
    if d.task == "arith":
        return Dataset.arith(n, seed, d.max_prompt_length, tokenizer=tokenizer, max_b=d.max_b,
                             split=split)
    if d.task == "arith_chain":
        return Dataset(arith.chain_problems(n, seed, d.chain_steps, max_b=d.max_b, split=split),
                       tokenizer, d.max_prompt_length, name="arith_chain")
    if d.task == "arith_tool":
        return Dataset(tool_arith.problems(n, seed, split=split), tokenizer,
                       d.max_prompt_length, name="arith_tool")
    # A vision-language policy reads rows' pictures; a text-only one refuses rows that have
    # them.
    from hfjax.models.qwen2_5_vl import read_config

    images = c.model.vision_depth > 0 or read_config(c.model.path) is not None
    if d.task == "shapes":
        return Dataset(shapes.problems(n, seed, split=split), tokenizer, d.max_prompt_length,
                       name=f"shapes {split}", images=images)
    if d.task == "parquet":
        files = d.train_files if train else d.val_files
        return Dataset.from_parquet(files.split(","), tokenizer, d.max_prompt_length,
                                    custom_reward_fn=c.reward.custom_fn or None, images=images)
    raise ValueError(f"unknown data.task {d.task!r}; use 'arith', 'arith_chain', 'shapes' or "
                     "'arith_tool' (built in) "
                     "or 'parquet' "
                     "(with data.train_files and data.val_files)")


def task_splits(cfg, tokenizer) -> tuple[Dataset, Dataset]:
    """A run's (train, test) prompts (`task_dataset`), refused in one line when a test problem
    occurs in training (`data.allow_overlap` lets it through, logged)."""
    train, test = (task_dataset(cfg, tokenizer, s) for s in ("train", "test"))
    holdout.check_disjoint(map(holdout.problem_key, train.rows),
                           map(holdout.problem_key, test.rows),
                           f"{test.name} against {train.name}", "data.allow_overlap=True",
                           allow=bool(cfg.data.get("allow_overlap", False)))
    return train, test

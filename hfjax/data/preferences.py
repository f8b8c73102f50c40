"""Preference data for reward and cost models: parquet rows of (prompt, chosen, rejected).

A row is
    prompt            str, or [{role, content}] chat messages
    chosen            str (the preferred response), or messages ending in the assistant turn
    rejected          str, or messages ending in the assistant turn
    chosen_unsafe     bool, optional: the chosen response is costly (Safe-RLHF's labels, which
    rejected_unsafe   bool, optional  a cost model learns to put above 0)

Prompts are rendered like RL prompts (the chat template when the tokenizer has one, with the
generation prompt), responses are encoded and followed by EOS, so a trained model sees its
sequences exactly as the actor's rollouts will present them. Every row is checked when the data
is loaded, before anything compiles: a missing column or field is an error naming the file,
the row and the field; pairs that do not fit the configured lengths are skipped and counted.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from absl import logging

from hfjax.controller.batch import Batch
from hfjax.data.batching import left_pad, right_pad
from hfjax.data.dataset import render_prompt

REQUIRED_COLUMNS = ("prompt", "chosen", "rejected")
LABEL_COLUMNS = ("chosen_unsafe", "rejected_unsafe")
TARGETS = ("reward", "cost")


@dataclasses.dataclass(frozen=True)
class Pair:
    """One tokenized preference pair (and its cost labels, when the data has them)."""

    prompt_ids: tuple[int, ...]
    chosen_ids: tuple[int, ...]
    rejected_ids: tuple[int, ...]
    chosen_unsafe: bool | None = None
    rejected_unsafe: bool | None = None


@dataclasses.dataclass
class PreferenceData:
    """Pairs, and what was read and skipped (reason -> count)."""

    pairs: list[Pair]
    source: str
    rows_read: int = 0
    skipped: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def labelled(self) -> bool:
        """Whether every pair carries chosen_unsafe / rejected_unsafe labels."""
        return bool(self.pairs) and all(p.chosen_unsafe is not None for p in self.pairs)

    def summary(self) -> str:
        skips = ", ".join(f"{n} {why}" for why, n in sorted(self.skipped.items())) or "none"
        return (f"{self.source}: read {self.rows_read} pairs, kept {len(self.pairs)}; "
                f"skipped: {skips}")

    def arrays(self, *, prompt_width: int, response_width: int, pad_id: int,
               target: str = "reward") -> Batch:
        """Host Batch of every pair: chosen_ids / chosen_mask and rejected_ids /
        rejected_mask [N, prompt_width + response_width] (prompt left-padded, response
        right-padded), and with labels chosen_sign / rejected_sign (+1 costly, -1 not).

        For target "cost" the sides swap: a cost model must score the rejected (costlier)
        response above the chosen one, so it becomes the "chosen" of the pairwise loss.
        """
        if target not in TARGETS:
            raise ValueError(f"unknown preference target {target!r}; choose one of {TARGETS}")
        prompts = [p.prompt_ids for p in self.pairs]
        first = [p.chosen_ids for p in self.pairs]
        second = [p.rejected_ids for p in self.pairs]
        labels = ([p.chosen_unsafe for p in self.pairs], [p.rejected_unsafe for p in self.pairs])
        if target == "cost":
            first, second = second, first
            labels = labels[::-1]
        pid, pm = left_pad(prompts, prompt_width, pad_id)
        out = {}
        for name, responses in (("chosen", first), ("rejected", second)):
            rid, rm = right_pad(responses, response_width, pad_id)
            out[f"{name}_ids"] = np.concatenate([pid, rid], 1)
            out[f"{name}_mask"] = np.concatenate([pm, rm], 1)
        if self.labelled:
            for name, flags in zip(("chosen", "rejected"), labels):
                out[f"{name}_sign"] = np.where(np.asarray(flags, bool), 1.0, -1.0).astype(
                    np.float32)
        return Batch(out)


def _response_text(value, where: str, field: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple, np.ndarray)) and len(value):
        last = value[-1]
        if isinstance(last, dict) and last.get("role") == "assistant" \
                and isinstance(last.get("content"), str):
            return last["content"]
        raise ValueError(f"{where}: field {field} is a conversation whose last message is not "
                         "an assistant turn with string content")
    raise ValueError(f"{where}: field {field} is {type(value).__name__}, expected the response "
                     "as a string (or messages ending in the assistant turn)")


def _prompt_messages(value, where: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, (list, tuple, np.ndarray)) and len(value):
        msgs = []
        for j, m in enumerate(value):
            if not isinstance(m, dict) or not isinstance(m.get("content"), str):
                raise ValueError(f"{where}: field prompt[{j}] needs role and string content")
            msgs.append({"role": m.get("role") or "user", "content": m["content"]})
        return msgs
    raise ValueError(f"{where}: field prompt is {type(value).__name__}, expected a string or "
                     "chat messages")


def _flag(value, where: str, field: str) -> bool | None:
    if value is None:
        return None
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{where}: field {field} is {type(value).__name__}, expected bool")
    return bool(value)


def load_parquet(files: str | Sequence[str], tok, *, max_prompt_length: int,
                 max_response_length: int) -> PreferenceData:
    """Pairs from preference parquet files (module docstring); ValueError naming the file,
    row and field for missing columns or malformed rows."""
    paths = [files] if isinstance(files, (str, os.PathLike)) else list(files)
    if not paths or not all(paths):
        raise ValueError("no preference parquet files given; write some with python -m "
                         "launch.prepare_data --task=arith_prefs, or point rm.train_files at "
                         "yours")
    eos = [] if tok.eos_id is None else [tok.eos_id]
    pairs, skipped, read = [], {}, 0
    for path in paths:
        if not os.path.isfile(path):
            raise ValueError(f"preference parquet file {path} does not exist")
        table = pq.read_table(path)
        missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
        if missing:
            raise ValueError(
                f"parquet {path}: missing column(s) {', '.join(missing)}; preference data has "
                f"columns prompt, chosen, rejected (found: {', '.join(table.column_names)})")
        for i, row in enumerate(table.to_pylist()):
            read += 1
            where = f"parquet {path} row {i}"
            for field in REQUIRED_COLUMNS:
                if row.get(field) is None:
                    raise ValueError(f"{where}: missing field {field}")
            prompt = render_prompt(tok, _prompt_messages(row["prompt"], where))
            chosen = tok.encode(_response_text(row["chosen"], where, "chosen"),
                                add_special_tokens=False) + eos
            rejected = tok.encode(_response_text(row["rejected"], where, "rejected"),
                                  add_special_tokens=False) + eos
            why = None
            if len(prompt) > max_prompt_length:
                why = "prompt longer than data.max_prompt_length"
            elif max(len(chosen), len(rejected)) > max_response_length:
                why = "response longer than the response length"
            if why:
                skipped[why] = skipped.get(why, 0) + 1
                continue
            pairs.append(Pair(tuple(prompt), tuple(chosen), tuple(rejected),
                              _flag(row.get("chosen_unsafe"), where, "chosen_unsafe"),
                              _flag(row.get("rejected_unsafe"), where, "rejected_unsafe")))
    data = PreferenceData(pairs, ", ".join(os.path.basename(p) for p in paths), read, skipped)
    if skipped:
        logging.warning("%s", data.summary())
    if not pairs:
        raise ValueError(f"no usable preference pairs: {data.summary()}")
    return data


_MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))


def write_rows(rows: list[dict], path: str | os.PathLike) -> None:
    """Writes preference rows (prompt as chat messages; chosen / rejected strings; optional
    cost labels and data_source) to one parquet file."""
    if not rows:
        raise ValueError(f"no preference rows to write to {path}")
    cols = {
        "prompt": pa.array([r["prompt"] for r in rows], _MESSAGES),
        "chosen": pa.array([r["chosen"] for r in rows], pa.string()),
        "rejected": pa.array([r["rejected"] for r in rows], pa.string()),
    }
    if "data_source" in rows[0]:
        cols["data_source"] = pa.array([r["data_source"] for r in rows], pa.string())
    for name in LABEL_COLUMNS:
        if name in rows[0]:
            cols[name] = pa.array([r[name] for r in rows], pa.bool_())
    pq.write_table(pa.table(cols), os.fspath(path))

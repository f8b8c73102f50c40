"""Supervised fine-tuning data: (prompt, response) examples with a loss mask on the response.

An example is the prompt's token ids, the response's token ids, and a 0/1 loss flag per
response token; the loss is taken only where the flag is 1. Sources:

- pairs of texts (`from_texts`), e.g. the embedded task's demonstrations: prompt ids as the
  tokenizer writes them, response ids followed by EOS;
- verl-style SFT parquet (`load_parquet`), one row per example, either
  - `prompt` (a string, or chat messages) and `response` (a string): the prompt is rendered
    with the chat template when the tokenizer has one (ending in the generation prompt), and
    the response's tokens and EOS carry the loss; or
  - `messages` (a multi-turn conversation, needs a chat template): everything up to the first
    assistant turn is the prompt; every assistant turn carries the loss, the other turns and the
    template's own headers do not. Tool-use conversations (`tool` messages, assistant
    `tool_calls` in OpenAI's format) are laid out token for token as a multi-turn rollout:
    the tool's results are context, never loss (`conversation`).

Column names are settable (`prompt_key`, `response_key`, `messages_key`). Examples whose
prompt or response does not fit the configured lengths are skipped and counted, never cut.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import numpy as np
import pyarrow.parquet as pq
from absl import logging

from hfjax.agents.render import rollout_layout


@dataclasses.dataclass(frozen=True)
class SFTExample:
    """One supervised example: prompt ids, response ids and a 0/1 loss flag per response id."""

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]


@dataclasses.dataclass
class SFTData:
    """Examples, and what was read and skipped (reason -> count)."""

    examples: list[SFTExample]
    source: str
    rows_read: int = 0
    skipped: dict[str, int] = dataclasses.field(default_factory=dict)

    def summary(self) -> str:
        skips = ", ".join(f"{n} {why}" for why, n in sorted(self.skipped.items())) or "none"
        return (f"{self.source}: read {self.rows_read} examples, kept {len(self.examples)}; "
                f"skipped: {skips}")

    def arrays(self) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
        """(prompt ids, response ids, loss masks), one list per example."""
        return ([list(e.prompt_ids) for e in self.examples],
                [list(e.response_ids) for e in self.examples],
                [list(e.loss_mask) for e in self.examples])


def _encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _eos(tok) -> list[int]:
    return [] if tok.eos_id is None else [tok.eos_id]


def from_texts(tok, pairs: Sequence[tuple[str, str]], source: str = "texts") -> SFTData:
    """Examples from (prompt text, response text) pairs: the prompt encoded as written, the
    response encoded and followed by EOS, all of it under the loss."""
    out = []
    for prompt, response in pairs:
        ids = _encode(tok, response) + _eos(tok)
        out.append(SFTExample(tuple(_encode(tok, prompt)), tuple(ids), (1,) * len(ids)))
    return SFTData(out, source, rows_read=len(out))


def _messages(value, where: str) -> list[dict]:
    if isinstance(value, str) or not isinstance(value, (list, tuple, np.ndarray)):
        raise ValueError(f"{where}: expected a list of {{role, content}} messages, got "
                         f"{type(value).__name__}")
    msgs = []
    for j, m in enumerate(value):
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        content = m.get("content") if isinstance(m, dict) else None
        if calls is not None and content is None:
            content = ""  # an assistant message that only calls tools
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                or not isinstance(content, str):
            raise ValueError(f"{where}: message {j} needs string fields role and content")
        msgs.append({"role": m["role"], "content": content})
        if calls is not None and len(calls):
            if m["role"] != "assistant":
                raise ValueError(f"{where}: message {j} is a {m['role']!r} message with "
                                 "tool_calls; only assistant messages make calls")
            msgs[-1]["tool_calls"] = [dict(c) for c in calls]
    return msgs


def _prompt_ids(tok, prompt, where: str) -> list[int]:
    if isinstance(prompt, str):
        if tok.chat_template:
            return tok.apply_chat_template([{"role": "user", "content": prompt}],
                                           add_generation_prompt=True, tokenize=True)
        return _encode(tok, prompt)
    msgs = _messages(prompt, where)
    if not msgs:
        raise ValueError(f"{where}: empty prompt")
    if tok.chat_template:
        return tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    return _encode(tok, msgs[-1]["content"])


def conversation(tok, messages: list[dict], where: str) -> SFTExample:
    """A multi-turn conversation as one example: the prompt runs to the first assistant turn
    (with the generation prompt); each assistant turn's tokens, as the chat template writes
    them, carry the loss. Needs a chat template whose renderings of a conversation's prefixes
    are prefixes of each other (true of common templates); ValueError otherwise.

    A tool-use conversation (`tool` messages, or assistant messages with `tool_calls`) is laid
    out as a multi-turn rollout lays out a trajectory (`hfjax.agents.render.rollout_layout`):
    the policy's turns carry the loss, the tool turns (the template's text around the results
    included) are context, and the token sequence is the one RL trains on."""
    if any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
        try:
            prompt, ids, mask = rollout_layout(tok, messages, where)
        except ValueError as err:
            raise ValueError(f"{err} (tool-use demonstrations are laid out as rollouts)") \
                from None
        return SFTExample(tuple(prompt), tuple(ids), tuple(mask))
    if not tok.chat_template:
        raise ValueError(f"{where}: a messages conversation needs a tokenizer with a chat "
                         "template; use prompt/response columns for plain text")
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns or turns[0] == 0:
        raise ValueError(f"{where}: a conversation needs a user turn before an assistant turn")
    first = turns[0]
    prompt = tok.apply_chat_template(messages[:first], add_generation_prompt=True, tokenize=True)
    ids, mask = list(prompt), []
    for k in range(first, len(messages)):
        if messages[k]["role"] == "assistant":
            # The assistant header is part of the prefix rendered with the generation prompt.
            head = tok.apply_chat_template(messages[:k], add_generation_prompt=True,
                                           tokenize=True)
            _extend(ids, mask, head, 0, where)
        full = tok.apply_chat_template(messages[: k + 1], add_generation_prompt=False,
                                       tokenize=True)
        _extend(ids, mask, full, int(messages[k]["role"] == "assistant"), where)
    n = len(prompt)
    return SFTExample(tuple(prompt), tuple(ids[n:]), tuple(mask))


def _extend(ids: list[int], mask: list[int], rendered: list[int], flag: int, where: str):
    if rendered[: len(ids)] != ids:
        raise ValueError(f"{where}: the chat template renders a longer conversation with a "
                         "different beginning, so turns cannot be told apart; use "
                         "prompt/response columns")
    new = rendered[len(ids):]
    ids.extend(new)
    mask.extend([flag] * len(new))


def load_parquet(files: str | Sequence[str], tok, *, max_prompt_length: int,
                 max_response_length: int, prompt_key: str = "prompt",
                 response_key: str = "response", messages_key: str = "messages") -> SFTData:
    """Examples from SFT parquet files (see the module docstring); ValueError naming the file,
    row and field for a malformed row or missing columns."""
    paths = [files] if isinstance(files, (str, os.PathLike)) else list(files)
    if not paths or not all(paths):
        raise ValueError("no SFT parquet files given (sft.train_files)")
    examples, skipped, read = [], {}, 0
    for path in paths:
        if not os.path.isfile(path):
            raise ValueError(f"SFT parquet file {path} does not exist")
        table = pq.read_table(path)
        cols = set(table.column_names)
        multi = messages_key in cols
        if not multi and not {prompt_key, response_key} <= cols:
            raise ValueError(
                f"parquet {path}: an SFT file needs columns {prompt_key!r} and "
                f"{response_key!r}, or {messages_key!r} (found: {', '.join(sorted(cols))})")
        for i, row in enumerate(table.to_pylist()):
            read += 1
            where = f"parquet {path} row {i}"
            if multi:
                ex = conversation(tok, _messages(row[messages_key], where), where)
            else:
                response = row.get(response_key)
                if not isinstance(response, str):
                    raise ValueError(f"{where}: field {response_key} is "
                                     f"{type(response).__name__}, expected str")
                if row.get(prompt_key) is None:
                    raise ValueError(f"{where}: missing field {prompt_key}")
                rids = _encode(tok, response) + _eos(tok)
                ex = SFTExample(tuple(_prompt_ids(tok, row[prompt_key], where)), tuple(rids),
                                (1,) * len(rids))
            why = _too_long(ex, max_prompt_length, max_response_length)
            if why:
                skipped[why] = skipped.get(why, 0) + 1
                continue
            examples.append(ex)
    data = SFTData(examples, ", ".join(os.path.basename(p) for p in paths), read, skipped)
    if skipped:
        logging.warning("%s", data.summary())
    if not examples:
        raise ValueError(f"no usable SFT examples: {data.summary()}; raise "
                         "data.max_prompt_length or sft.max_response_length")
    return data


def _too_long(ex: SFTExample, max_prompt: int, max_response: int) -> str | None:
    if len(ex.prompt_ids) > max_prompt:
        return "prompt longer than data.max_prompt_length"
    if len(ex.response_ids) > max_response:
        return "response longer than sft.max_response_length"
    if not any(ex.loss_mask):
        return "no response token to learn"
    return None

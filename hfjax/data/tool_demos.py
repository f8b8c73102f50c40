"""Tool-use demonstrations for a warm start before RL with tools (ReTool's recipe: supervised
calls first, so that RL has trajectories that call the tool to reinforce).

For a prompt row whose problem is one arithmetic expression (reasoning-gym's
`basic_arithmetic` and `chain_sum` keep it in the entry's metadata; `arith_tool` rows hold
their operands), a demonstration is the row's prompt messages followed by

    assistant: calls the calculator on the expression (OpenAI-style `tool_calls`)
    tool:      the calculator's result, as the real tool answers the call
    assistant: "#### <result>", the answer format the task's instruction asks for

in a verl-style multi-turn SFT parquet file (`messages` column). `hfjax.data.sft` lays such a
conversation out as a rollout (the tool's turn is context, not loss). The call goes through a
real `ToolRunner`, parsed from the text the policy would write, so the result is the one a
rollout would show; a row whose result differs from its ground truth (e.g. a division the
calculator writes as a decimal) is skipped and counted.
"""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq

from hfjax.agents.render import assistant_text
from hfjax.tools import ToolRunner, parse_tool_calls, resolve_tools

TOOL = "calculator"
_CALL = pa.struct([("type", pa.string()), ("function", pa.struct(
    [("name", pa.string()), ("arguments", pa.string())]))])
_MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string()),
                                ("tool_calls", pa.list_(_CALL))]))


def expression(row: dict) -> str | None:
    """The arithmetic expression a row's question asks for, or None when it has none."""
    extra = row.get("extra_info") or {}
    if "a" in extra and "b" in extra:  # arith_tool
        return f"{extra['a']}*{extra['b']}"
    entry = extra.get("entry")
    if isinstance(entry, str):
        try:
            meta = json.loads(entry).get("metadata") or {}
        except (json.JSONDecodeError, AttributeError):
            return None
        expr = meta.get("expression")
        return expr if isinstance(expr, str) and expr.strip() else None
    return None


def demonstrations(rows: list[dict], tools: str) -> tuple[list[dict], dict[str, int]]:
    """(demonstration rows, skipped reason -> count) for prompt rows written with `tools`
    (module docstring). ValueError when `tools` has no calculator or no row has an
    expression."""
    resolved = resolve_tools(tools) if tools.strip() else {}
    if TOOL not in resolved:
        raise ValueError(f"tool-use demonstrations call the {TOOL}; add it to --tools "
                         f"(got {tools!r})")
    out, skipped = [], {}
    with ToolRunner({TOOL: resolved[TOOL]}) as runner:
        for row in rows:
            expr = expression(row)
            if expr is None:
                skipped["no expression"] = skipped.get("no expression", 0) + 1
                continue
            call = {"type": "function", "function": {
                "name": TOOL, "arguments": json.dumps({"expression": expr})}}
            assistant = {"role": "assistant", "content": "", "tool_calls": [call]}
            obs = runner.run(parse_tool_calls(assistant_text(assistant)))[0]
            truth = str(row["reward_model"]["ground_truth"]).strip()
            if obs.error or obs.text.strip() != truth:
                skipped["tool result differs from the answer"] = \
                    skipped.get("tool result differs from the answer", 0) + 1
                continue
            messages = [dict(m, tool_calls=None) for m in row["prompt"]] + [
                assistant, {"role": "tool", "content": obs.text, "tool_calls": None},
                {"role": "assistant", "content": f"#### {obs.text.strip()}",
                 "tool_calls": None}]
            out.append({"data_source": row["data_source"], "messages": messages,
                        "extra_info": {"index": (row.get("extra_info") or {}).get("index"),
                                       "ground_truth": truth}})
    if not out:
        raise ValueError(f"no tool-use demonstrations: {skipped}; the task's rows need an "
                         "arithmetic expression (basic_arithmetic, chain_sum, arith_tool)")
    return out, skipped


def write_demonstrations(rows: list[dict], path: str | os.PathLike) -> None:
    """Demonstration rows to one SFT parquet file (columns data_source, messages,
    extra_info)."""
    table = pa.table({
        "data_source": pa.array([r["data_source"] for r in rows], pa.string()),
        "messages": pa.array([r["messages"] for r in rows], _MESSAGES),
        "extra_info": pa.array([r["extra_info"] for r in rows]),
    })
    pq.write_table(table, os.fspath(path))

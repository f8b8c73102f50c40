"""How a tool turn is written into a trajectory: the text that follows a policy turn ending in
tool calls (the observations, as the tokenizer's chat template renders `tool` messages), and
the id of the close tag that ends a call; and the same layout for a whole tool-use conversation
(`rollout_layout`), which SFT on demonstrations uses so that it trains on the token sequence a
rollout produces."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

from hfjax.tools import Observation
from hfjax.tools.parse import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

RESPONSE_OPEN = "<tool_response>"
RESPONSE_CLOSE = "</tool_response>"
# Ends a tool result cut to max_tool_response_len tokens, so the policy can tell a cut
# result from a whole one.
CUT_MARK = " [cut]"
_MARK = "\x00HFJAX_TURN_END\x00"


def observation_renderer(tokenizer) -> Callable[[Sequence[Observation]], str]:
    """fn(observations) -> the text that follows a policy turn ending in a tool call, up to
    where the policy's next turn starts.

    With a chat template: what the template writes after an assistant message for the `tool`
    messages holding the observations, with the generation prompt (e.g. Qwen's
    `<|im_end|>` ... `<tool_response>` ... `<|im_start|>assistant`). Without one:
    `<tool_response>TEXT</tool_response>` per observation. ValueError when the template cannot
    render tool messages."""
    if not getattr(tokenizer, "chat_template", None):
        return lambda obs: "".join(f"{RESPONSE_OPEN}{o.text}{RESPONSE_CLOSE}" for o in obs)

    def render(obs: Sequence[Observation]) -> str:
        messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _MARK}]
        messages += [{"role": "tool", "content": o.text} for o in obs]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        at = text.find(_MARK)
        if at < 0:
            raise ValueError("the chat template drops the assistant's content; multi-turn "
                             "rollouts need a template that renders assistant and tool messages")
        return text[at + len(_MARK):]

    try:
        render([Observation("1", False)])
    except Exception as err:  # a template error: say which feature is missing
        raise ValueError(f"the tokenizer's chat template cannot render a 'tool' message "
                         f"({err}); multi-turn rollouts need one that does") from err
    return render


def close_tag_id(tokenizer) -> int | None:
    """The id of `</tool_call>` when the tokenizer encodes it as one token, else None (the
    loop then finds the tag in the decoded text)."""
    ids = tokenizer.encode(TOOL_CALL_CLOSE, add_special_tokens=False)
    return int(ids[0]) if len(ids) == 1 else None


def call_text(call: dict) -> str:
    """One entry of an assistant message's `tool_calls` (OpenAI's `{"type": "function",
    "function": {"name", "arguments"}}`, or `{"name", "arguments"}`; arguments a dict or its
    JSON text) as the policy writes a call in a rollout: `<tool_call>\\n{JSON}\\n</tool_call>`,
    the format the tools' system message shows. ValueError for anything else."""
    fn = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError(f"tool call {call!r}: expected {{'function': {{'name', 'arguments'}}}}")
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as err:
            raise ValueError(f"tool call {fn['name']!r}: arguments are not JSON ({err})") from None
    if not isinstance(args, dict):
        raise ValueError(f"tool call {fn['name']!r}: arguments must be a JSON object")
    body = json.dumps({"name": fn["name"], "arguments": args}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


def assistant_text(message: dict) -> str:
    """An assistant message's text as the policy writes it: its content, then its
    `tool_calls` (if any) as call blocks (`call_text`)."""
    calls = message.get("tool_calls") or []
    return (message.get("content") or "") + "".join(call_text(c) for c in calls)


def rollout_layout(tokenizer, messages: Sequence[dict],
                   where: str = "conversation") -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, response ids, 0/1 loss mask per response id) of a tool-use conversation,
    laid out token for token as `AgentLoop` lays out a trajectory, so that SFT on a
    demonstration and RL on a rollout see the same sequence:
    - the prompt: the messages before the first assistant turn, rendered by the chat template
      with the generation prompt (as RL data's prompts are);
    - each assistant turn: its text (`assistant_text`) encoded, loss 1; a turn followed by tool
      messages must end with its last call's `</tool_call>`, where a rollout's turn stops;
    - each run of `tool` messages: the observations rendered as the loop renders them
      (`observation_renderer`: for a chat template, the end of the assistant's turn, the tool
      messages and the next assistant header), loss 0;
    - the last assistant turn: its text and EOS, loss 1. It must be the last message.
    ValueError, naming `where`, for any other shape."""
    msgs = list(messages)
    roles = [m.get("role") for m in msgs]
    if "assistant" not in roles or roles.index("assistant") == 0:
        raise ValueError(f"{where}: a conversation needs a prompt before its first assistant "
                         "turn")
    first = roles.index("assistant")
    if tokenizer.chat_template:
        prompt = tokenizer.apply_chat_template(msgs[:first], add_generation_prompt=True,
                                               tokenize=True)
    else:
        prompt = tokenizer.encode(msgs[first - 1]["content"], add_special_tokens=False)
    render = observation_renderer(tokenizer)
    ids: list[int] = []
    mask: list[int] = []
    k = first
    while k < len(msgs):
        if roles[k] != "assistant":
            raise ValueError(f"{where}: message {k} is a {roles[k]!r} turn after an assistant "
                             "turn without a tool call; a rollout has only tool turns there")
        try:
            text = assistant_text(msgs[k])
        except ValueError as err:
            raise ValueError(f"{where}: message {k}: {err}") from None
        j = k + 1
        while j < len(msgs) and roles[j] == "tool":
            j += 1
        turn = tokenizer.encode(text, add_special_tokens=False)
        if j == k + 1:  # no tool turn follows: the trajectory's last turn
            if j != len(msgs):
                raise ValueError(f"{where}: message {j} ({roles[j]!r}) follows an assistant "
                                 "turn without a tool call; only tool turns can")
            eos = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
            ids += turn + eos
            mask += [1] * (len(turn) + len(eos))
            break
        if not text.endswith(TOOL_CALL_CLOSE):
            raise ValueError(f"{where}: assistant message {k} is followed by tool results, so "
                             f"it must end with its call's {TOOL_CALL_CLOSE} (a rollout's turn "
                             "stops there)")
        obs = [Observation(str(m.get("content") or ""), False) for m in msgs[k + 1:j]]
        tool = tokenizer.encode(render(obs), add_special_tokens=False)
        ids += turn + tool
        mask += [1] * len(turn) + [0] * len(tool)
        if j == len(msgs):
            raise ValueError(f"{where}: the conversation ends with a tool turn; end it with the "
                             "assistant's answer")
        k = j
    return list(prompt), ids, mask

"""How a tool turn is written into a trajectory: the text that follows a policy turn ending in
tool calls (the observations, as the tokenizer's chat template renders `tool` messages), and
the id of the close tag that ends a call."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hfjax.tools import Observation
from hfjax.tools.parse import TOOL_CALL_CLOSE

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

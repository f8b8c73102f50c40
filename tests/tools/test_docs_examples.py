"""docs/agents.md's Python examples run as written and do what the page says."""

import importlib
import os
import re

import configs.grpo_arith  # noqa: F401  (the page's fourth example imports it; a build dep)
from hfjax.tools import Observation, ToolCall, ToolRunner, resolve_tools

# The checkout (realpath: under Bazel this file is a link in the runfiles, which hold no docs).
DOC = os.path.join(os.path.dirname(os.path.realpath(__file__)), "..", "..", "docs", "agents.md")


def test_agents_md_examples(capsys, tmp_path, monkeypatch):
    with open(DOC, encoding="utf-8") as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    assert len(blocks) == 4
    # The tool is written to a module of its own, as a user would: the runner's worker
    # processes import it by name.
    (tmp_path / "agents_md_word_count.py").write_text(blocks[0])
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module("agents_md_word_count")
    scope = {"__name__": "agents_md"}
    for block in blocks[1:]:
        exec(compile(block, DOC, "exec"), scope)
    # The second block prints what its comment says.
    assert capsys.readouterr().out.strip() == "[Observation(text='7006652', error=False)]"
    # The first registered word_count, which behaves as documented.
    with ToolRunner(resolve_tools("word_count")) as runner:
        two, empty, unknown = runner.run([
            ToolCall("word_count", {"text": "a b a", "word": "a"}),
            ToolCall("word_count", {"text": "a b", "word": " "}),
            ToolCall("word_count", {"text": "a", "n": 1})])
    assert two == Observation("2", False)
    assert empty.error and empty.text.startswith("Error: word_count: word is empty")
    assert unknown.error and "unknown 'n'" in unknown.text
    # The third is the python tool with other limits (built only where its jail can start:
    # elsewhere it refuses, tests/tools/test_python_jail.py).
    from hfjax.tools import jail

    try:
        jail.probe()
    except jail.JailUnavailable:
        pass
    else:
        slow = scope["SlowPython"]()
        assert (slow.name, slow.wall_s, slow.memory_mb, slow.cpu_s) == ("python", 30.0, 2048,
                                                                        40)
    # The fourth switches a config to multi-turn rollouts; the config checks accept it.
    from hfjax.config import check_config

    assert scope["c"].rollout.multi_turn.enable
    check_config(scope["c"])

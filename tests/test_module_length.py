"""The house rule on module length: a Python module of the project is at most 600 lines, or its
docstring says why it is longer ("past 600 lines" or "over 600 lines", with the reason)."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
LIMIT = 600
TREES = ("hfjax", "launch", "configs", "bench", "scripts", "tests")
REASON = re.compile(r"(past|over) 600 lines")


def test_every_module_is_short_or_says_why():
    long = []
    for tree in TREES:
        for path in sorted((ROOT / tree).rglob("*.py")):
            text = path.read_text()
            if text.count("\n") <= LIMIT:
                continue
            doc = ast.get_docstring(ast.parse(text)) or ""
            if not REASON.search(doc):
                long.append(f"{path.relative_to(ROOT)} ({text.count(chr(10))} lines)")
    assert not long, (f"modules over {LIMIT} lines whose docstring does not say why: {long}; "
                      "split them where a concept separates, or say why in the docstring")

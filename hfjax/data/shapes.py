"""The embedded visual task (data.task=shapes): count the red squares in a picture.

A 56 x 56 picture (4 x 4 cells of 14 pixels, one vision patch each) holds 1 to 4 red squares
and 0 to 3 blue ones in distinct cells, drawn with Pillow; the prompt is the picture and the
same text for every row ("<image>="), so the answer is only in the picture. The answer
comes after `####`, scored by the arithmetic task's rule reward. A picture is a function of
its cells alone, so its bytes identify the problem: the held-out partition
(`hfjax.data.holdout`, keyed on the question and its pictures' bytes) splits the pictures, and
no test picture occurs in training whatever the seeds. Rows follow verl's multimodal schema
(an `images` column of {"bytes": PNG}).
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image, ImageDraw

from hfjax.data import arith, holdout
from hfjax.data.images import PLACEHOLDER, VISION_TOKENS
from hfjax.models.tokenizer import Tokenizer

DATA_SOURCE = "hfjax/shapes"
QUESTION = "="  # in the character vocabulary; the picture says the rest
CELLS, CELL = 4, 14


def tokenizer() -> Tokenizer:
    """The arithmetic task's character tokenizer plus the image placeholder and the vision
    tokens (ids 18 to 21)."""
    tok = arith.tokenizer()
    tok.backend.add_special_tokens([PLACEHOLDER, *VISION_TOKENS])
    return tok


def render(red: tuple[int, ...], blue: tuple[int, ...]) -> bytes:
    """The PNG of red squares in cells `red` and blue ones in `blue` (cell = row * 4 + col)."""
    img = Image.new("RGB", (CELLS * CELL, CELLS * CELL), "white")
    draw = ImageDraw.Draw(img)
    for cells, colour in ((red, (220, 30, 30)), (blue, (30, 60, 220))):
        for c in cells:
            y, x = divmod(int(c), CELLS)
            draw.rectangle([x * CELL + 2, y * CELL + 2, x * CELL + CELL - 3, y * CELL + CELL - 3],
                           fill=colour)
    out = io.BytesIO()
    img.save(out, format="PNG")
    return out.getvalue()


def problems(n: int, seed: int, split: str | None = None) -> list[dict]:
    """n verl-schema rows with one picture each; `split` "train" draws pictures outside the
    held-out part of the space, "test" only distinct held-out ones (None: any)."""
    rng = np.random.default_rng(seed)
    keep = holdout.keeper(split, n, "shapes test split", "lower data.n_test")
    rows = []
    while len(rows) < n:
        k_red, k_blue = int(rng.integers(1, 5)), int(rng.integers(0, 4))
        cells = rng.permutation(CELLS * CELLS)[:k_red + k_blue]
        red, blue = tuple(sorted(cells[:k_red])), tuple(sorted(cells[k_red:]))
        row = {"data_source": DATA_SOURCE,
               "prompt": [{"role": "user", "content": PLACEHOLDER + QUESTION}],
               "images": [{"bytes": render(red, blue)}],
               "ability": "vision",
               "reward_model": {"style": "rule", "ground_truth": str(k_red)},
               "extra_info": {"index": len(rows), "red": list(map(int, red)),
                              "blue": list(map(int, blue))}}
        if keep(holdout.problem_key(row)):
            rows.append(row)
    return rows


def sft_texts(rows: list[dict], corrupt_frac: float, seed: int) -> list[str]:
    """Deliberately imperfect demonstrations for `rows` (the arithmetic task's "format"
    corruption): the answer after `####`, but in a fraction `corrupt_frac` of them the bare
    count, which the reward rejects. The counts are right: what RL can add is the form, and
    whatever the warm start did not learn of reading the picture."""
    rng = np.random.default_rng(seed)
    return [(r["reward_model"]["ground_truth"] if rng.random() < corrupt_frac
             else f"#### {r['reward_model']['ground_truth']}") for r in rows]

"""Shape buckets: the widths that prompt blocks and response budgets are padded to, so that a
run compiles a few programs instead of one per length. The sampler, the prompt batches, the
grouped micro-batches, the response columns and the dry run all pad with these."""

from __future__ import annotations

MIN_PROMPT_BUCKET = 16
MIN_NEW_TOKENS_BUCKET = 16
DEFAULT_MAX_PROMPT_LEN = 4096


def bucket_size(length: int, minimum: int, cap: int | None = None, *, fine: bool = False) -> int:
    """The shape a length is padded to: the smallest power of two >= max(length, minimum), or
    with `fine` also 3/4 of one (16, 24, 32, 48, 64, 96, 128, 192, 256, ...: at most a third
    of the columns padding instead of half, for twice the shapes); at most `cap` when given."""
    n = max(int(length), int(minimum), 1)
    size = 1 << (n - 1).bit_length()
    if fine and size >= 4 and size * 3 // 4 >= n:
        size = size * 3 // 4
    return size if cap is None else min(size, int(cap))


def prompt_bucket(length: int, minimum: int = MIN_PROMPT_BUCKET, cap: int | None = None) -> int:
    """The width a block of prompts whose longest has `length` tokens is left-padded to, in the
    sampler, the prompt batches, the grouped micro-batches and the dry run alike: 16, 24, 32,
    48, 64, ... (`bucket_size(..., fine=True)`)."""
    return bucket_size(length, minimum, cap, fine=True)

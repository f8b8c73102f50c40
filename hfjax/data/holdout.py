"""Held-out means unseen: which problems are held out, and the check that a test set is.

Every generated task splits its problem space once, by the problem's identity, independent of
seeds and sizes: a problem is held out when the hash of its key (`problem_key`) falls in the
first `HELDOUT_FRAC` of the hash range. Test rows are drawn only from held-out problems and
training rows (RL prompts, SFT demonstrations, preference pairs) only from the rest, so no run,
whatever its seed, trains on a problem any other run tests on.

A problem's key is its question: the last prompt message, lower-cased with runs of whitespace
made one space (`normalize`), so a reasoning-gym question differing only in case or spacing is
the same question. For the generated tasks the question is the problem: "47+8=" holds the
arithmetic task's operands and operator, and names the chain task's chain (start value 47,
step 8; the step count is the run's setting), "123*4567=" the tool task's operands. A system
message (the tools' description) is no part of the key.

`check_disjoint` is the check data loaders run on a train/test pair they are handed (parquet
written elsewhere): it refuses overlapping sets in one line unless overlap is explicitly
allowed, which is logged.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable

from absl import logging

HELDOUT_FRAC = 1 / 3  # of each generated task's problem space, kept for testing only


def normalize(text: str) -> str:
    """Text compared for sameness: lower case, runs of whitespace as one space, trimmed."""
    return " ".join(text.lower().split())


def problem_key(row: dict) -> str:
    """The identity of a row's problem: its last prompt message (or its prompt, when a string),
    `normalize`d (module docstring), and a digest of its pictures' bytes when it has any (a
    visual question's text is often the same for every picture)."""
    prompt = row["prompt"]
    text = prompt if isinstance(prompt, str) else prompt[-1]["content"]
    pictures = row.get("images") or ()
    if not len(pictures):
        return normalize(text)
    digest = hashlib.blake2b(digest_size=16)
    for p in pictures:
        digest.update(p.get("bytes") if isinstance(p, dict) else p)
    return f"{normalize(text)} [images {digest.hexdigest()}]"


def _fraction(key: str) -> float:
    """The key's place in [0, 1): a stable hash (not Python's salted `hash`)."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0 ** 64


def is_heldout(key: str) -> bool:
    """Whether the problem with this key belongs to the test side of its task's space."""
    return _fraction(key) < HELDOUT_FRAC


def keeper(split: str | None, n: int, what: str, fix: str) -> Callable[[str], bool]:
    """A filter for a generator's stream of problem keys, keeping `split`'s side of the
    partition: "train" keeps problems not held out (repeats allowed: training draws with
    replacement), "test" keeps held-out ones, each once, None keeps all. Past 60 n + 2000
    draws for a test split of `n` it raises ValueError naming `what` and `fix`: the held-out
    part of a small space has fewer distinct problems than asked for."""
    if split not in (None, "train", "test"):
        raise ValueError(f"split={split!r}: use 'train', 'test' or None")
    seen: set[str] = set()
    tries, limit = 0, 60 * n + 2000

    def keep(key: str) -> bool:
        nonlocal tries
        tries += 1
        if split is None:
            return True
        if split == "test" and tries > limit:
            raise ValueError(f"{what}: only {len(seen)} distinct held-out problems found in "
                             f"{limit} draws, fewer than the {n} asked for; {fix}")
        if is_heldout(key) != (split == "test"):
            return False
        if split == "test":
            if key in seen:
                return False
            seen.add(key)
        return True

    return keep


def overlap(train_keys: Iterable, test_keys: Iterable) -> list:
    """The test keys that also occur in training, in test order, each once."""
    seen, out = set(train_keys), []
    for key in test_keys:
        if key in seen and key not in out:
            out.append(key)
    return out


def check_disjoint(train_keys: Iterable, test_keys: Iterable, what: str, setting: str,
                   allow: bool = False) -> int:
    """Refuses (ValueError, one line) a test set sharing problems with its training set, naming
    how many and the first; with `allow`, logs a warning instead. Returns the overlap's size."""
    test_keys = list(test_keys)
    shared = overlap(train_keys, test_keys)
    if not shared:
        return 0
    message = (f"{what}: {len(shared)} of {len(test_keys)} test problems also occur in the "
               f"training data (the first: {str(shared[0])[:80]!r}), so the held-out score "
               "would measure memory; use disjoint files (launch.prepare_data writes them)")
    if not allow:
        raise ValueError(f"{message}, or set {setting} to allow it")
    logging.warning("%s; allowed by %s", message, setting)
    return len(shared)

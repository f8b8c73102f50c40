"""A reward scorer process: `python -m hfjax.rewards.scorer`, driven by `RewardPool`.

It reads one JSON request per line on stdin and answers with JSON lines on the stdout it was
started with:
- request `{"id", "fn": ["module", mod, qualname] | ["file", "path.py:fn"], "args": [...]}`;
- `{"id", "event": "start"}` once the function is imported, so the parent's per-call timeout
  measures the call and not the import;
- then `{"id", "event": "done", "score": float}` or `{"id", "event": "error", "error": str}`.

A request without "args" only imports the function: it answers `{"id", "event": "loading"}`,
then `{"id", "event": "loaded"}` or an error (the pool's `preload`, which times the import).

The function's own prints go to stderr (fd 1 is pointed there), so nothing it writes can be
mistaken for an answer. Functions are named, never pickled. A watchdog thread ends the process
when its parent dies, even while a reward function hangs.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import signal
import sys
import threading
import time

_CACHE: dict[tuple, object] = {}


def resolve(ref: list) -> object:
    """The function a reference names (imported once per process)."""
    key = tuple(ref)
    if key not in _CACHE:
        if ref[0] == "module":
            obj = importlib.import_module(ref[1])
            for part in ref[2].split("."):
                obj = getattr(obj, part)
        elif ref[0] == "file":
            from hfjax.rewards.custom import load_custom_reward

            obj = load_custom_reward(ref[1])
        else:
            raise ValueError(f"unknown function reference {ref!r}")
        _CACHE[key] = obj
    return _CACHE[key]


def to_score(out) -> float:
    """The float a reward function returned (or its dict's "score"); ValueError otherwise."""
    if isinstance(out, dict):
        if "score" not in out:
            raise ValueError(f"reward returned a dict without 'score': keys {sorted(out)}")
        out = out["score"]
    value = float(out)
    if not math.isfinite(value):
        raise ValueError(f"reward returned a non-finite score {value}")
    return value


def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(3)


def main() -> None:
    # The parent handles Ctrl-C and ends its scorers itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    answers = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()

    def send(msg: dict) -> None:
        answers.write(json.dumps(msg) + "\n")
        answers.flush()

    for line in sys.stdin:
        req = json.loads(line)
        rid = req["id"]
        load_only = "args" not in req
        if load_only:
            send({"id": rid, "event": "loading"})  # the pool times the import from here
        try:
            fn = resolve(req["fn"])
        except BaseException as err:  # noqa: B036  (report anything, keep serving)
            # A load-only request's error is shown to the user as it is (it names the file).
            text = str(err) if load_only and isinstance(err, ValueError) else _describe(err)
            send({"id": rid, "event": "error", "error": f"loading the reward: {text}"})
            continue
        if load_only:
            send({"id": rid, "event": "loaded"})
            continue
        send({"id": rid, "event": "start"})
        try:
            value = to_score(fn(*req["args"]))
        except BaseException as err:  # noqa: B036  (SystemExit, library timeouts included)
            send({"id": rid, "event": "error", "error": _describe(err)})
            continue
        send({"id": rid, "event": "done", "score": value})


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"[:500]


if __name__ == "__main__":
    main()

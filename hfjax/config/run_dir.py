"""How a training run's directory is recognised on disk, without loading JAX or orbax: the
config checks read it (a `--model` that is a run, a `trainer.resume` path), and
`hfjax.run.checkpoint` writes the layout it describes."""

from __future__ import annotations

import os

# The item of a checkpoint step that holds the trainer's own state (step, data cursor, RNG).
TRAINER_ITEM = "trainer"


def is_run(path: str) -> bool:
    """Whether `path` is a training run's out_dir, checkpoint root or step directory (what
    `hfjax.run.checkpoint.locate` takes) rather than a model directory."""
    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, "config.json")):
        return False
    if os.path.isdir(os.path.join(path, "checkpoints")):
        return True
    if os.path.basename(os.path.normpath(path)).isdigit():
        return os.path.isdir(os.path.join(path, TRAINER_ITEM))
    return any(name.isdigit() for name in os.listdir(path))

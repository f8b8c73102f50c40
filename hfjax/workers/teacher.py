"""On-policy distillation's teacher: a causal LM on its own pool that scores the student's
samples, forward only, as the reference scores them (the actor's micro-batches and packing,
logits at the rollout's temperature), returning `teacher_log_prob` [B, R].

The teacher is any model hfjax loads (`teacher.path`: an HF directory, a .gguf file or a
preset) that shares the student's tokenizer; a vocabulary of another size is refused in one
line (`check_vocabulary`) before anything loads or compiles.
"""

from __future__ import annotations

from hfjax.controller.batch import Batch
from hfjax.controller.protocol import DP_COMPUTE, method
from hfjax.workers.actor import Reference
from hfjax.workers.base import SEQUENCES


class Teacher(Reference):
    """The teacher's worker group: a frozen scorer of the student's sampled tokens."""

    @method(DP_COMPUTE, reads=SEQUENCES)
    def compute_teacher_log_prob(self, batch: Batch) -> Batch:
        """Batch with `teacher_log_prob` [B, R]: the teacher's log-prob of each sampled
        token."""
        lp, _ = self._log_probs(batch)
        return Batch({"teacher_log_prob": lp})


def check_vocabulary(path: str, teacher_vocab: int, student_vocab: int) -> None:
    """ValueError (one line) unless the teacher's vocabulary is the student's."""
    if teacher_vocab != student_vocab:
        raise ValueError(
            f"teacher.path={path!r} has a vocabulary of {teacher_vocab} tokens, the student's "
            f"has {student_vocab}; on-policy distillation scores the student's tokens, so the "
            "teacher must share its tokenizer: give a teacher of the same model family")

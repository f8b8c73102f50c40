"""The actor's training rules, chosen from its meshes: with `actor.rules=auto` the layouts of
the 3D-HybridEngine follow from `actor.mesh` and `rollout.mesh` alone.

Without a decode mesh (or with the engine off) the actor trains in the standard rules, "train"
(FSDP over `embed`, tensor parallelism over heads, mlp and vocab). With one, the engine needs
every device's training shard to lie inside its decoding shard; the candidates are tried in
order, "train" first (it nests whenever the decode tensor size divides the training tensor
size: fsdp then joins the micro-DP groups), then "nested_train" (fsdp splits the dimensions
tensor splits where it divides them, so a decode tensor size dividing fsdp x tensor nests; a
tensor whose heads fsdp does not divide keeps fsdp on embed and, where it cannot nest, moves by
a plain transfer, logged by the engine). The first that nests is used and logged; when none
does, the LayoutError names each candidate's reason, except on a mesh that splits rows over
`sequence`, whose parameters (replicated over it) the engine then reshards by plain transfers
under "train".
"""

from __future__ import annotations

from typing import Any

from absl import logging
from jax.sharding import Mesh

from hfjax.engine.hybrid import HybridEngine, LayoutError, engine_for, splits_rows
from hfjax.parallel.sharding import layout

AUTO = "auto"
CANDIDATES = ("train", "nested_train")


def actor_rules_and_engine(mesh: Mesh, rules: Any, decode_mesh: str,
                           state: Any) -> tuple[Any, HybridEngine | None]:
    """Returns (the training rules, the hybrid engine or None) for an actor on `mesh`.

    `rules` is a rule-set name, a rules dict, or "auto" (choose, see the module docstring);
    `decode_mesh` is `RolloutSpec.decode_mesh` ("" for no hybrid engine). Raises LayoutError
    when the decode mesh cannot hold the model or no candidate nests in it.
    """
    if rules != AUTO:
        return rules, engine_for(layout(mesh, rules), decode_mesh, state)
    if not decode_mesh:
        return CANDIDATES[0], None
    reasons = []
    for candidate in CANDIDATES:
        try:
            engine = HybridEngine(layout(mesh, candidate), decode_mesh, state)
        except LayoutError as err:
            if "cannot hold the model" in str(err) or "only 'data'" in str(err):
                raise  # the decode mesh itself is wrong: no training rules can help
            reasons.append(f"{candidate}: {err}")
            continue
        logging.info("actor.rules=auto: training rules %r nest inside rollout.mesh %r on "
                     "actor.mesh %s%s", candidate, decode_mesh, dict(mesh.shape),
                     f" ({'; '.join(reasons)})" if reasons else "")
        return candidate, engine
    if splits_rows(mesh):
        # Sequence parallelism: no rules nest; the engine reshards by plain transfers.
        return CANDIDATES[0], engine_for(layout(mesh, CANDIDATES[0]), decode_mesh, state)
    used = {a: n for a, n in mesh.shape.items() if n > 1}
    raise LayoutError(
        f"rollout.mesh {decode_mesh!r} cannot hold the training shards of the actor's mesh {used} "
        "under any training rules "
        f"({'; '.join(reasons)}); pick a decode tensor size that divides the actor's "
        "fsdp x tensor size")

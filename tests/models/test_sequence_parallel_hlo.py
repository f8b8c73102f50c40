"""Sequence parallelism keeps its split in the compiled programs (hfjax.models.sequence_parallel).

Equal numbers cannot show where work runs: a program that gathers whole rows before every
matmul gives the same log-probs. These tests read the optimized HLO of the programs that run
on split rows (the actor's log-probs and their gradient, a critic's values and a score
model's scores, forward and backward) and fail on any all-gather, all-reduce or reduce-scatter
that moves an activation at a row's full length, and on any matmul with more tokens than a
device's T / s; and they check that each scheme compiles its own exchange (Ulysses:
all-to-all; ring: collective-permute of key / value blocks) for the groups a config builds.
"""

import dataclasses
import math
import re
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hfjax.models import sequence_parallel as sp
from hfjax.models import transformer
from hfjax.models.config import ModelConfig
from hfjax.parallel.hlo import collectives
from hfjax.parallel.mesh import ResourcePool, batch_sharding
from hfjax.workers.base import WorkerGroup
from hfjax.workers.logprobs import response_logprobs

# Sizes chosen so that no feature size (D, F, V, N * H, K * H) equals a row length or a
# multiple of one: a collective's shape then says which it carries. The vocab outgrows every
# micro-batch's tokens here (4 rows on each of 2 shards, 352 tokens), as a real model's does:
# with a table split over vocab that is when XLA would rather all-reduce the looked-up rows
# than gather the table.
CFG = ModelConfig(vocab_size=400, hidden_size=48, intermediate_size=72, num_layers=1,
                  num_heads=4, num_kv_heads=4, head_dim=8)
PROMPT, RESPONSE = 13, 30
T = PROMPT + RESPONSE  # 43 columns: padded to W = 44 on sequence=4
S = 4  # the sequence size of every mesh here
W = -(-T // S) * S
FEATURES = {48, 72, 400, 32}
# With tensor=2: 8 query heads and 4 kv heads (2 per tensor shard, repeated twice for Ulysses
# on sequence=4); the features as a tensor shard holds them too (MLP 36, vocab 200, q 32, kv 16).
TP_CFG = dataclasses.replace(CFG, num_heads=8, num_kv_heads=4)
TP_FEATURES = {48, 72, 36, 400, 200, 64, 32, 16}

_DOT = re.compile(r"= (\w+)\[([\d,]*)\]\S* dot\(")


def row_gathers(text: str, rows: int, lengths=(T, W, RESPONSE)) -> list[str]:
    """The all-gathers / all-reduces / reduce-scatters that move float activations at a row's
    full length (T or its padded width, or the response, times any row count up to `rows`)."""
    full = {b * n for b in range(1, rows + 1) for n in lengths}
    bad = []
    for c in collectives(text):
        if c.op in ("all-to-all", "collective-permute") or c.group == 1:
            continue
        if any(dt[0] in "fb" and set(dims) & full for dt, dims in c.shapes):
            bad.append(c.line[:300])
    return bad


def dot_tokens(text: str, features=FEATURES) -> list[tuple[tuple[int, ...], int]]:
    """(shape, tokens) of every dot whose result has a feature dimension: tokens is the product
    of its other dimensions (rows x positions on the device)."""
    out = []
    for _, dims in _DOT.findall(text):
        shape = tuple(int(d) for d in dims.split(",") if d)
        if set(shape) & features:
            out.append((shape, math.prod(d for d in shape if d not in features)))
    return out


def programs_hlo(mesh: str, mode: str, rows: int, rules: str = "train", cfg=CFG,
                 samples: int = 1) -> str:
    """One program holding the actor's log-probs (LM head chunked; with `samples` > 1 as
    shared-prompt rows of that many samples), a critic's values and a score model's scores on
    `rows` rows per data-parallel shard, and the gradients of all three, compiled for `mesh`
    with `mode`, the actor under the training `rules`."""
    n = math.prod(int(a.split("=")[1]) for a in mesh.split(","))
    pool = ResourcePool("all", tuple(jax.devices())[:n])
    groups = [WorkerGroup(name, pool, mesh, transformer.build(cfg, head, seed=1),
                          rules=rules if name == "actor" else "train", sequence_parallel=mode)
              for name, head in (("actor", "causal_lm"), ("critic", "value"),
                                 ("reward_model", "score"))]
    actor, critic, score = groups
    dp = actor.dp_size
    B = rows * dp
    ids = jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=batch_sharding(actor.mesh))

    def loss(params, ids):
        mask = (ids >= 0).astype(jnp.int32)
        # A budget of 5 positions per row: the head scans over chunks of each device's 11.
        lp, ent = response_logprobs(actor.model(params[0]), ids, mask, RESPONSE, 1.0,
                                    samples=samples, chunk=5 * rows, dp=dp)
        values = critic.model(params[1])(ids, mask)
        # A score model's forward only: reward and cost models score, they do not train here.
        scores = score.model(jax.lax.stop_gradient(params[2]))(ids, mask)
        return jnp.mean(lp) + jnp.mean(ent) + jnp.mean(values) + jnp.mean(scores)

    params = tuple(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                               sharding=x.sharding), g.params)
                   for g in groups)
    fn = actor.jit(jax.value_and_grad(loss))
    return fn.lower(params, ids).compile().as_text()


# (mesh, rows per data-parallel shard, the actor's rules): one row per shard was always split;
# more than one made XLA gather whole rows before every matmul (the [B * T, D] reshape). The
# nested rules (the hybrid engine's, which configs/grpo_long.py's actor trains under) store the
# embedding table split over vocab on fsdp x sequence: the lookup all-reduced whole rows'
# embeddings (and all-gathered their gradient) until the table was gathered before use.
CASES = [("fsdp=2,sequence=4", 1, "train"), ("fsdp=2,sequence=4", 2, "train"),
         ("fsdp=2,sequence=4", 4, "train"), ("sequence=4", 2, "train"),
         ("fsdp=2,sequence=4", 1, "nested_train")]


@pytest.mark.parametrize("mode", sp.MODES)
@pytest.mark.parametrize(("mesh", "rows", "rules"), CASES)
def test_split_programs_move_no_whole_rows(mesh, mode, rows, rules):
    check_split(programs_hlo(mesh, mode, rows, rules), mode, rows, FEATURES)


@pytest.mark.parametrize("mode", sp.MODES)
def test_split_programs_with_tensor_parallel_heads(mode):
    """tensor=2 beside sequence=4: heads split over `tensor` (Megatron's all-reduces of the
    row-parallel outputs are over `tensor`, on T / s tokens) and tokens over `sequence`."""
    check_split(programs_hlo("tensor=2,sequence=4", mode, 2, cfg=TP_CFG), mode, 2, TP_FEATURES)


@pytest.mark.parametrize("mode", sp.MODES)
def test_shared_prompt_rows_keep_their_split(mode):
    """The actor's groups of 2 samples as shared-prompt rows (13 + 2 x 30 = 73 columns, padded
    to 76): their hidden states stay split, the head runs on each device's own columns."""
    width = PROMPT + 2 * RESPONSE
    check_split(programs_hlo("fsdp=2,sequence=4", mode, 4, samples=2), mode, 4, FEATURES,
                lengths=(T, W, RESPONSE, width, -(-width // S) * S))


@pytest.mark.parametrize("mode", sp.MODES)
def test_compact_shared_rows_keep_their_split(mode, monkeypatch):
    """Length-grouped micro-batches as compact shared-prompt rows (responses end to end, each
    as long as it is) on fsdp=2,sequence=4: the actor's log-probs and their gradient gather no
    hidden states of a row's columns or response tokens, and run no matmul on more than a
    device's columns."""
    sys.path.insert(0, "tests")
    from flax import nnx
    from support import padded_rl_batch

    from hfjax.engine import grouping, shared_prompt
    from hfjax.parallel import sharding as shd
    from hfjax.workers.logprobs import compact_logprobs

    monkeypatch.setattr(shared_prompt, "COMPACT_MAX_FRACTION", 1.0)
    n = 2
    # 4 groups of 2: 2 compact rows per data-parallel shard, 62 columns (padded to 64).
    batch = padded_rl_batch(0, 8, PROMPT, RESPONSE, CFG.vocab_size, samples=n)
    arrays = {k: jnp.asarray(batch[k]) for k in ("input_ids", "attention_mask", "responses")}
    (cut,) = grouping.plan(grouping.extents(arrays["attention_mask"], RESPONSE), 8, PROMPT,
                           RESPONSE, 2, group=n)
    assert cut.compact is not None
    mb = grouping.cut(arrays, cut, RESPONSE)
    width = mb["compact_src"].shape[1] * n  # the compact row's columns
    graphdef, state = nnx.split(transformer.build(CFG, seed=1))
    pool = ResourcePool("all", tuple(jax.devices()))
    lay = shd.layout(pool.mesh("fsdp=2,sequence=4"), "train", sequence_parallel=mode)

    def loss(state):
        lp, ent = compact_logprobs(nnx.merge(graphdef, state), mb, 1.0, n, chunk=5, dp=2)
        return jnp.sum(lp) + jnp.sum(ent)

    text = jax.jit(shd.under_layout(lay, jax.grad(loss))).lower(state).compile().as_text()
    padded = -(-width // S) * S
    assert (width, padded) == (62, 64)
    # Hidden states [.., tokens, D] gathered for a row's columns or its response tokens
    # (`compact_pred`'s S = 48 per row: cutting the predicting positions out first did that).
    # Per-token log-probs may move: they are scalars.
    tokens = {k * x for k in range(1, 5) for x in (width, padded, mb["compact_pred"].shape[1] * n)}
    hidden = [c.line[:200] for c in collectives(text)
              if c.group > 1 and c.op in ("all-gather", "all-reduce", "reduce-scatter")
              and any(len(d) >= 3 and d[-1] == CFG.hidden_size and set(d[:-1]) & tokens
                      for _, d in c.shapes)]
    assert hidden == []
    assert max(t for _, t in dot_tokens(text)) <= 2 * padded // S


def check_split(text: str, mode: str, rows: int, features, lengths=(T, W, RESPONSE)) -> None:
    local = rows * W // S
    assert row_gathers(text, 2 * rows, lengths) == []
    dots = dot_tokens(text, features)
    assert dots, "no token matmul found"
    too_many = [(shape, n) for shape, n in dots if n > local]
    assert too_many == [], f"matmuls on more than {local} tokens per device: {too_many}"
    # The projections run on exactly the device's rows x T / s tokens (the head on chunks).
    assert any(n == local for _, n in dots)
    # Ulysses' exchange: all-to-alls of [b, C, heads, head_dim] activations. (Shared-prompt
    # rows' per-token log-probs may go back to the padded rows' order by an all-to-all of
    # scalars; that is not an exchange.)
    moved = {c.op for c in collectives(text) if c.group != 1
             and any(set(d) & (features | {CFG.head_dim}) for _, d in c.shapes)}
    if mode == "ulysses":
        assert "all-to-all" in moved
    else:
        assert "all-to-all" not in moved and "collective-permute" in moved


# Ring's update under each remat policy: (k / v passes, placement passes). A pass of the k and
# v blocks is s steps' permutes of [b, T / 2s, K, H] pairs (counted once: the step is a scan
# body); a placement pass moves q, k, v to their zig-zag places and the output back. Keeping
# matmul outputs keeps the placed q, k, v and the output home (`sp.EXCHANGED`, as Ulysses'
# exchanges are kept), so the backward recomputes the steps (blocks round again: 3 passes)
# but not the placement; `full` recomputes both, `none` neither.
RING_PASSES = {"none": (2, 2), "dots_no_batch": (3, 2), "dots": (3, 2), "full": (3, 3)}


@pytest.mark.parametrize("policy", sorted(RING_PASSES))
def test_ring_update_permutes_what_its_remat_policy_implies(policy):
    cfg = dataclasses.replace(CFG, num_heads=4, num_kv_heads=2, num_layers=2,
                              remat_policy=policy)
    pool = ResourcePool("all", tuple(jax.devices()))
    group = WorkerGroup("actor", pool, "fsdp=2,sequence=4",
                        transformer.build(cfg, "causal_lm", seed=1), sequence_parallel="ring")
    rows = 2
    ids = jax.ShapeDtypeStruct((rows * group.dp_size, T), jnp.int32,
                               sharding=batch_sharding(group.mesh))

    def loss(params, ids):
        lp, _ = response_logprobs(group.model(params), ids, (ids >= 0).astype(jnp.int32),
                                  RESPONSE, 1.0, chunk=5 * rows, dp=group.dp_size)
        return jnp.mean(lp)

    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          group.params)
    text = group.jit(jax.value_and_grad(loss)).lower(params, ids).compile().as_text()
    moved = sum(c.nbytes for c in collectives(text) if c.op == "collective-permute"
                and any(dt == "f32" and len(d) == 4 for dt, d in c.shapes))
    kv_passes, placements = RING_PASSES[policy]
    N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    block = rows * 2 * -(-W // S // 2) * H * 4  # a device's two half-shards, one head, f32
    assert moved == block * (2 * K * kv_passes + (2 * N + 2 * K) * placements)


def attention_exchange(text: str) -> set[str]:
    """The schemes whose attention exchange a program holds: "ulysses" for an all-to-all,
    "ring" for a collective-permute of [b, C, heads, head_dim] key / value blocks."""
    found = set()
    for c in collectives(text):
        if c.op == "all-to-all" and c.group > 1:
            found.add("ulysses")
        if c.op == "collective-permute" and any(dt[0] in "fb" and len(d) == 4
                                                for dt, d in c.shapes):
            found.add("ring")
    return found


def test_each_role_compiles_the_scheme_its_config_names(tmp_path):
    """Every role of a Safe-RLHF run as the run builds it from a config (the dry run's abstract
    groups), each with its own `<role>.sequence_parallel`: the actor (log-probs and update,
    under the hybrid engine's nested rules), the reference, the critic (values and update) and
    the reward and cost models (scoring). Each compiled program holds its scheme's exchange and
    not the other's, and gathers no whole rows."""
    sys.path.insert(0, "tests")
    from support import tiny_rl_config

    from hfjax.models import save_hf
    from hfjax.models.config import scratch_model_config
    from hfjax.run import dry_run

    # hidden 48, responses of 11: no parameter's dimension is a multiple of a row's length
    # (8 + 11 = 19 columns, padded to 20) or of the response's, up to 4 rows. The vocab (392)
    # outgrows a micro-batch's 8 x 20 tokens, as a real model's does.
    mesh = "fsdp=2,sequence=4"
    c = tiny_rl_config(algorithm="safe_rlhf", mesh=mesh, hidden=48)
    c.algo.adv_estimator = "safe_rlhf"
    c.model.num_heads = c.model.num_kv_heads = 4
    c.model.vocab_size = 392
    c.rollout.response_length = 11
    # The nested rules store the embedding table split over vocab on fsdp x sequence.
    c.actor.rules = "nested_train"
    for i, role in enumerate(("reward_model", "cost_model")):
        mcfg = scratch_model_config(c.model, 0, 0, 1, 64)
        c[role].path = save_hf(transformer.build(mcfg, "score", seed=i),
                               str(tmp_path / role))
        c[role].mesh = mesh
    want = {"actor": "ring", "ref": "ulysses", "critic": "ring", "reward_model": "ring",
            "cost_model": "ulysses"}
    for role, mode in want.items():
        c[role].sequence_parallel = mode
    w = dry_run.abstract_groups(c)
    shape = dry_run.step_shape(w, c)
    seen, gathers = {}, {}
    lengths = (shape.width, sp.padded_width(shape.width, w.actor.layout), shape.response_len)
    names = ("actor.log_prob", "actor.update", "ref.log_prob", "critic.values",
             "critic.update", "reward_model.score", "cost_model.score")
    for _role, group in dry_run.device_groups(w):
        for p in group.programs(shape):
            if p.name in names:
                text = p.fn.lower(*p.args).compile().as_text()
                seen[p.name] = attention_exchange(text)
                gathers[p.name] = row_gathers(text, 4, lengths)
    assert w.actor.layout.rules["vocab"] == ("tensor", "fsdp", "sequence")
    assert seen == {name: {want[name.split(".")[0]]} for name in names}
    # The updates (forward and backward through the losses) move no whole rows either.
    assert gathers == {name: [] for name in seen}, (lengths, gathers)


def test_row_gathers_are_seen_on_a_program_that_gathers_rows():
    """The check itself: a layer computed on whole rows (a [B, T, D] constraint) is caught."""
    pool = ResourcePool("all", tuple(jax.devices()))
    group = WorkerGroup("actor", pool, "fsdp=2,sequence=4", transformer.build(CFG))
    ids = jax.ShapeDtypeStruct((4, W), jnp.int32, sharding=batch_sharding(group.mesh))

    def whole(params, ids):
        model = group.model(params)
        h = model.model.embed(ids, split=True)
        h = jax.lax.with_sharding_constraint(h, NamedSharding(group.mesh, P("fsdp")))
        return jnp.sum(model.logits(h))

    text = group.jit(whole).lower(group.params, ids).compile().as_text()
    assert row_gathers(text, 4)
    assert any(n > 2 * W // S for _, n in dot_tokens(text))  # 2 rows per shard


# python tests/models/test_sequence_parallel_hlo.py MESH MODE ROWS [RULES]
if __name__ == "__main__":
    print("\n".join(row_gathers(programs_hlo(*sys.argv[1:3], int(sys.argv[3]), *sys.argv[4:5]),
                                2 * int(sys.argv[3]))))

"""The auto device mapping: enumeration (placements, allocations), the simulator's formulas,
the schedule, plans that the config and placement code accept, clear errors, and the paper's
findings on A100s (HybridFlow §8.4)."""

import math

import pytest

from hfjax.controller.placement import build_placement
from hfjax.models.presets import get_preset
from hfjax.parallel.mesh import MeshSpec
from hfjax.planner import search
from hfjax.planner.config import plan_inputs
from hfjax.planner.pricing import MeshLayout, ModelSpec
from hfjax.planner.simulator import (
    Efficiency,
    Simulator,
    StageTime,
    Workload,
    cluster_for,
)

BELL = [1, 1, 2, 5, 15, 52]


@pytest.mark.parametrize("n", range(1, 6))
def test_set_partitions_are_every_partition_once(n):
    items = [f"m{i}" for i in range(n)]
    parts = search.set_partitions(items)
    assert len(parts) == BELL[n]
    canon = {frozenset(frozenset(block) for block in p) for p in parts}
    assert len(canon) == len(parts)  # no partition twice
    for p in parts:
        assert sorted(x for block in p for x in block) == sorted(items)


def test_compositions_split_exactly_and_respect_minimums():
    sizes = [[2, 4, 6], [1, 2, 3, 4, 5], [4, 8]]
    out = list(search._compositions(10, sizes))
    assert out and all(sum(c) == 10 for c in out)
    expected = {(a, b, c) for a in sizes[0] for b in sizes[1] for c in sizes[2]
                if a + b + c == 10}
    assert set(out) == expected


def test_granularity_keeps_at_most_64_pool_sizes():
    assert [search.granularity(n) for n in (8, 64, 65, 128, 256, 1024)] == [1, 1, 2, 2, 4, 16]


def test_schedule_adds_on_a_pool_and_overlaps_disjoint_pools():
    flow = search.rlhf_dataflow(("actor", "critic", "ref", "reward"))
    assert [s.name for s in flow] == ["gen", "old_log_prob", "ref", "values", "reward",
                                      "update_critic", "update_actor"]
    t = {"gen": 10, "old_log_prob": 2, "ref": 3, "values": 4, "reward": 5,
         "update_critic": 7, "update_actor": 6}
    times = {k: StageTime(v, {}) for k, v in t.items()}
    together = search.schedule(flow, {r: "all" for r in ("actor", "critic", "ref", "reward")},
                                times)
    assert max(s.end for s in together) == sum(t.values())  # one pool: everything adds up
    split = {"actor": "a", "ref": "a", "critic": "c", "reward": "c"}
    sched = {s.name: s for s in search.schedule(flow, split, times)}
    # gen 0-10; pool a: old_log_prob 10-12, ref 12-15; pool c idles until gen's output,
    # values 10-14, reward 14-19; both updates wait for every score (19).
    assert (sched["ref"].start, sched["ref"].end) == (12, 15)
    assert (sched["reward"].start, sched["reward"].end) == (14, 19)
    assert sched["update_actor"].start == sched["update_critic"].start == 19
    assert max(s.end for s in sched.values()) == 19 + 7
    # A rule reward has no device stage: the updates wait only for the device scores.
    host = search.schedule(search.rlhf_dataflow(("actor", "critic", "reward")),
                            {"actor": "a", "critic": "c"},
                            {k: v for k, v in times.items() if k not in ("reward", "ref")})
    assert {s.name for s in host} == {"gen", "old_log_prob", "values", "update_critic",
                                      "update_actor"}


def _tiny_workload(**kw):
    base = dict(prompts=16, n=2, prompt_len=16, response_len=16, actor_mini=16,
                actor_micro=8, critic_mini=16, critic_micro=8)
    return Workload(**{**base, **kw})


def test_collectives_and_rooflines_by_hand():
    cluster = cluster_for("a100-80gb")
    eff = Efficiency(link=0.5, hbm=0.5, latency_intra_s=1e-5, latency_inter_s=3e-5)
    sim = Simulator(cluster, _tiny_workload(), eff)
    # 8 devices in one node: NVLink at 300 GB/s one way, half of it reached.
    assert sim.gather(8e9, 8, 8) == pytest.approx(1e-5 + 7 / 8 * 8e9 / 150e9)
    # 16 devices span two nodes: InfiniBand at 25 GB/s one way.
    assert sim.all_reduce(1e9, 16, 16) == pytest.approx(2 * (3e-5 + 15 / 16 * 1e9 / 12.5e9))
    assert sim.gather(1e9, 1, 8) == 0
    bf16 = ModelSpec("actor", get_preset("tiny").replace(dtype="bfloat16"))
    f32 = ModelSpec("actor", get_preset("tiny"))
    compute, memory = sim.roofline(bf16, 312e12, 2039e9, 0.5)
    assert (compute, memory) == pytest.approx((2.0, 2.0))
    assert sim.peak_flops(f32) == 156e12


def test_decode_is_memory_bound_by_hand():
    # One decode replica on one A100: each step reads the weights and the whole KV cache.
    cfg = get_preset("llama2-7b").replace(param_dtype="bfloat16", dtype="bfloat16")
    w = Workload(prompts=8, n=1, prompt_len=1024, response_len=1024, actor_mini=8,
                 actor_micro=8)
    eff = Efficiency(hbm=1.0)
    sim = Simulator(cluster_for("a100-80gb"), w, eff)
    model = ModelSpec("actor", cfg, "causal_lm", True)
    gen, _ = sim.generate(model, MeshLayout(), 1, engine=False)
    kv = 8 * 2048 * 2 * 32 * 32 * 128 * 2  # rows x slots x (K and V of 32 layers) x bf16
    step_bytes = 2 * cfg.num_params() + kv + 8 * 32000 * 4  # weights, cache, logits
    assert gen.parts["decode_memory"] == pytest.approx(1024 * step_bytes / 2039e9)
    assert gen.parts["decode_compute"] < gen.parts["decode_memory"] / 10
    assert gen.parts["transition"] == 0


def tiny_models(reward=True):
    cfg = get_preset("tiny").replace(num_heads=4, num_kv_heads=2)
    models = [ModelSpec("actor", cfg, "causal_lm", True), ModelSpec("critic", cfg, "value", True),
              ModelSpec("ref", cfg, "causal_lm", False)]
    if reward:
        models.append(ModelSpec("reward", cfg, "score", False))
    return models


def test_a_plan_is_a_placement_and_meshes_the_runs_accept():
    w = _tiny_workload()
    result = search.plan(tiny_models(reward=False), w, "h100", 8, host_roles=("reward",))
    assert result.placements == 5  # Bell(3): actor, critic, ref; the rule reward is on the host
    for p in [result.best, *result.alternatives]:
        assert sum(size for size, _ in p.pools.values()) == 8
        placement = build_placement(p.placement_string(), ("actor", "ref", "critic", "reward"), 8)
        pools = {name: plan.n_devices for name, plan in placement.pools.items()}
        for role, mesh in p.meshes().items():
            MeshSpec.parse(mesh).resolve(pools[placement.role_pool[role]])
        assert placement.role_pool["reward"] == placement.role_pool["actor"]
    best = result.best
    assert best.iteration_s == max(s.end for s in best.schedule)
    assert all(p.iteration_s >= best.iteration_s for p in result.alternatives)
    keys = set(best.overrides())
    assert {"placement", "actor.mesh", "critic.mesh", "ref.mesh", "actor.rules",
            "rollout.mesh"} <= keys
    summary = best.summary()
    assert set(summary) >= {"placement", "meshes", "estimated_iteration_s"}


def test_the_engine_is_on_exactly_where_the_decode_layout_differs():
    state = search._Search({m.role: m for m in tiny_models()},
                             Simulator(cluster_for("h100"), _tiny_workload()), 1e12)
    for lay, t_g, engine in state.layouts("actor", 8):
        same = lay.fsdp == 1 and t_g == lay.tensor
        assert engine != same
        if same:
            assert lay.rules == "train"
        # Decoding shards the weights no finer than training does (nesting).
        assert t_g <= lay.fsdp * lay.tensor


def test_memory_decides_the_minimum_allocation():
    # A Llama-2 13B actor alone: float32 weights and Adam moments, 16 B x 13.0e9 = 208 GB.
    cfg = get_preset("llama2-13b").replace(dtype="bfloat16", remat_policy="full")
    w = Workload(prompts=64, n=1, prompt_len=256, response_len=256, actor_mini=64,
                 actor_micro=64, gen_rows=-1)
    budget = 0.9 * 80e9
    state = search._Search({"actor": ModelSpec("actor", cfg, "causal_lm", True)},
                             Simulator(cluster_for("a100-80gb"), w), budget)
    assert 16 * cfg.num_params() / 2 > budget  # two devices cannot hold the state
    assert state.layouts("actor", 2)  # (though meshes over two exist)
    assert state.set_choice(("actor",), 2) is None
    # On 4 devices the state fits (52 GB each) but not with the update's two gradient
    # buffers (26 GB more); 5 to 7 devices have no mesh (40 heads, hidden 5120, micro-batch
    # 64); 8 devices hold it.
    assert 24 * cfg.num_params() / 4 > budget > 16 * cfg.num_params() / 4
    assert state.set_choice(("actor",), 4) is None
    assert not any(state.layouts("actor", n) for n in (3, 5, 6, 7))
    eight = state.set_choice(("actor",), 8)
    assert eight is not None and eight.peak_bytes <= budget
    result = search.plan([ModelSpec("actor", cfg, "causal_lm", True)], w, "a100-80gb", 16)
    assert result.min_allocation == {"actor": 8}


def test_bad_input_is_refused_clearly():
    w = _tiny_workload()
    with pytest.raises(search.PlanError, match="num_devices=0: plan for at least one device"):
        search.plan(tiny_models(), w, "h100", 0)
    with pytest.raises(ValueError, match="unknown target 'h300'; known targets: h100"):
        search.plan(tiny_models(), w, "h300", 8)
    # 7 devices: tensor must divide 4 heads and data x fsdp the micro-batch of 8.
    with pytest.raises(search.PlanError, match=r"no mesh over 7 devices can run actor.*"
                                                r"micro-batch of 8.*nearby: 1, 2, 4, 8"):
        search.plan(tiny_models(), w, "h100", 7)
    big = get_preset("llama3.1-70b").replace(dtype="bfloat16")
    models = [ModelSpec("actor", big, "causal_lm", True), ModelSpec("critic", big, "value", True)]
    with pytest.raises(search.PlanError, match=r"fit on no allocation of 8 x a100-40gb.*"
                                                r"actor \(70.55B\): does not fit on 8"):
        search.plan(models, w, "a100-40gb", 8)


def test_efficiency_flags_parse_and_refuse_nonsense():
    e = Efficiency.parse("train=0.3,hbm=0.6,call_overhead_s=0.001")
    assert (e.train, e.hbm, e.call_overhead_s, e.forward) == (0.3, 0.6, 0.001, 0.45)
    assert Efficiency.parse("fsdp_overlap=0").fsdp_overlap == 0
    for bad in ("train=1.5", "speed=1", "train", "hbm=x", "step_overhead_s=-1"):
        with pytest.raises(ValueError):
            Efficiency.parse(bad)


# -- the paper's findings ---------------------------------------------------------------------
#
# HybridFlow §8 on A100 80 GB: the workload is configs/hybridflow_paper.py (actor, critic,
# reference and reward model of one size, 1024 prompts of 1024 tokens and 1024-token responses,
# 8 mini-batches, scoring micro-batched and a paged decode), read as `launch.plan` reads it, so
# docs/scaling.md's table, the command line and these tests plan the same thing.


def paper_inputs(name):
    """(models, host roles, workload) of configs/hybridflow_paper.py with model.path=preset:NAME,
    as launch.plan builds them for an A100."""
    from configs import hybridflow_paper

    cfg = hybridflow_paper.get_config()
    cfg.model.path = f"preset:{name}"
    return plan_inputs(cfg, platform="gpu")


def paper_plan(name, n, **kw):
    models, host, workload = paper_inputs(name)
    return search.plan(models, workload, "a100-80gb", n, host_roles=host, alternatives=14, **kw)


def test_the_paper_config_is_the_papers_workload():
    models, host, w = paper_inputs("llama2-13b")
    assert host == ()
    assert [(m.role, m.head, m.trainable) for m in models] == [
        ("actor", "causal_lm", True), ("critic", "value", True), ("ref", "causal_lm", False),
        ("reward", "score", False)]
    assert {m.config.num_params() for m in models} == {get_preset("llama2-13b").num_params()}
    assert all(m.config.dtype == "bfloat16" and m.config.remat_policy == "full" for m in models)
    assert (w.prompts, w.n, w.prompt_len, w.response_len) == (1024, 1, 1024, 1024)
    assert (w.actor_mini, w.actor_micro, w.critic_mini, w.critic_micro) == (128,) * 4
    assert (w.score_micro, w.gen_rows, w.old_log_prob) == (128, -1, True)


@pytest.mark.slow
@pytest.mark.parametrize("name,n", [("llama2-7b", 16), ("llama2-7b", 32), ("llama2-7b", 64),
                                    ("llama2-13b", 16), ("llama2-13b", 32),
                                    ("llama2-13b", 64)])
def test_colocate_is_best_up_to_64_gpus(name, n):
    result = paper_plan(name, n)
    assert result.placements == 15
    assert result.best.mode == "colocate"


@pytest.mark.slow
def test_generation_takes_more_tensor_parallelism_than_fsdp_training_uses():
    """The paper's actor generates with t_g <= t (Megatron training needs tensor parallelism
    to fit; generation does not). hfjax trains with FSDP, which splits the weights without
    tensor-parallel all-reduces, so the planner picks little or no training t; decoding is
    bound by each replica's weight reads, which t_g divides, so it picks t_g = 8 (a node). The
    paper's relation holds for the weights' split: decode shards hold whole training shards
    (t_g divides fsdp x tensor), so the engine's micro-DP groups exist as in the paper."""
    result = paper_plan("llama2-7b", 16)
    actor = result.best.choices["actor"]
    assert actor.engine and actor.tensor_g == 8 > actor.layout.tensor
    assert (actor.layout.fsdp * actor.layout.tensor) % actor.tensor_g == 0
    models, _, workload = paper_inputs("llama2-7b")
    sim = Simulator(result.cluster, workload)
    model = models[0]
    at_t, _ = sim.generate(model, actor.layout, actor.layout.tensor, True, actor.gen_rows)
    chosen = actor.stages["gen"]
    # Decoding with the training tensor size reads t_g / t times the weights per replica.
    assert at_t.parts["decode_memory"] > 2 * chosen.parts["decode_memory"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama2-13b", "codellama-34b"])
def test_at_128_gpus_colocate_still_wins_because_only_generation_scales_sublinearly(name):
    """The paper finds split or standalone faster at 96-128 GPUs for 13B and 34B. This planner
    does not: in its model every stage but generation scales linearly from 64 to 128 devices
    (hfjax has no pipeline parallelism, whose bubbles grow as the micro-batches per replica
    shrink, and FSDP traffic hides behind compute), so running two sets concurrently on 64
    devices each gains nothing over running them in turn on 128, while generation, bound by
    each replica's weight reads, loses when the actor gets half the devices."""
    result = paper_plan(name, 128)
    assert result.seconds < 60  # planning 128 devices, on this machine
    best = result.best
    assert best.mode == "colocate"
    split = next(p for p in result.alternatives if p.mode == "split"
                 and all(sc.size == 64 for sc in p.sets.values()))
    colo = {s.name: s for s in best.schedule}
    half = {s.name: s for s in split.schedule}
    for stage in ("old_log_prob", "ref", "values", "reward", "update_critic", "update_actor"):
        # The stage's FLOPs split over twice the devices: its compute time halves exactly.
        assert half[stage].parts["compute"] == pytest.approx(2 * colo[stage].parts["compute"],
                                                             rel=0.02), stage
    # Two sets at once on 64 devices each finish scoring and training no sooner than one set
    # of 128 devices running them in turn (within 5%)...
    after_gen = [p.iteration_s - {s.name: s for s in p.schedule}["gen"].seconds
                 for p in (best, split)]
    assert after_gen[1] > 0.95 * after_gen[0]
    # ...while generating on 64 devices instead of 128 costs the split all of its deficit (to
    # 1%: with the 34B models the two finish scoring and training within 0.1% of each other).
    deficit = split.iteration_s - best.iteration_s
    assert deficit > 0 and half["gen"].seconds - colo["gen"].seconds >= 0.99 * deficit
    assert colo["gen"].seconds < half["gen"].seconds < 2 * colo["gen"].seconds


@pytest.mark.slow
def test_split_wins_at_128_gpus_when_fsdp_traffic_is_exposed():
    # With half of each call's compute hiding FSDP traffic (instead of all of it), the 34B
    # models' per-device traffic, which does not shrink with more devices, makes colocate pay
    # it four times in a row; two sets of 64 pay it twice at once: the paper's finding.
    result = paper_plan("codellama-34b", 128, efficiency=Efficiency(fsdp_overlap=0.5))
    assert result.best.mode in ("split", "standalone")
    colocate = next(p for p in result.alternatives if p.mode == "colocate")
    assert colocate.iteration_s > result.best.iteration_s
    assert math.isfinite(result.best.tokens_per_s)


def _doc_table():
    """The rows of docs/scaling.md's table of the paper's findings: (preset, GPUs, best mode,
    {mode: seconds}, actor mesh -> decode mesh)."""
    import os

    names = {"Llama-2 7B": "llama2-7b", "Llama-2 13B": "llama2-13b",
             "Code Llama 34B": "codellama-34b"}
    # The checkout (realpath: under Bazel this file is a link in the runfiles, which hold no
    # docs/).
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
    with open(os.path.join(root, "docs", "scaling.md")) as f:
        text = f.read()
    table = text[text.index("### The paper's findings"):text.index("### Example plans")]
    rows = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 7 and cells[0] in names:
            seconds = {mode: float(c) for mode, c in
                       zip(("colocate", "split", "standalone"), cells[3:6]) if c != "—"}
            rows.append((names[cells[0]], int(cells[1]), cells[2], seconds, cells[6]))
    return rows


@pytest.mark.slow
def test_the_docs_table_is_what_the_paper_config_plans():
    rows = _doc_table()
    assert len(rows) == 8
    for name, n, mode, seconds, layouts in rows:
        result = paper_plan(name, n)
        best = {}
        for p in [result.best, *result.alternatives]:
            if p.mode not in best or p.iteration_s < best[p.mode].iteration_s:
                best[p.mode] = p
        assert result.best.mode == mode, (name, n)
        assert {m: round(p.iteration_s, 1) for m, p in best.items()} == seconds, (name, n)
        actor = result.best.choices["actor"]
        assert f"{actor.layout.mesh} → {actor.decode_mesh}" == layouts, (name, n)


def test_a_calibration_file_moves_the_plan_the_way_it_measured():
    from hfjax.parallel.targets import get_target
    from hfjax.planner.simulator import efficiency_from_calibration

    cfg = get_preset("qwen2.5-1.5b").replace(dtype="bfloat16", remat_policy="full")
    models = [ModelSpec("actor", cfg, "causal_lm", True), ModelSpec("ref", cfg, "causal_lm", False)]
    w = Workload(prompts=64, n=8, prompt_len=32, response_len=256, actor_mini=512,
                 actor_micro=128)
    h200 = get_target("h200")

    def measured(decode_share, mfu):
        # bench.accelerator's JSON: a decode step at `decode_share` of the matmul bound (the
        # measured peak = the table's), update and scoring at `mfu` of the table peak.
        return {"decode_ms_per_step": 10.0, "decode_bound_ms": 10.0 * decode_share,
                "matmul_peak_flops": h200.bf16_flops, "update_mfu": mfu, "ref_mfu": mfu,
                "mfu_peak": "table", "config": {"remat_policy": "none"}}

    slow = efficiency_from_calibration(measured(0.05, 0.1), h200)
    fast = efficiency_from_calibration(measured(0.95, 0.9), h200)
    assert (slow.decode, slow.train, slow.forward) == pytest.approx((0.05, 0.1, 0.1))
    assert fast.hbm == Efficiency().hbm  # what was not measured keeps its value
    # A recomputing run's MFU leaves out the recomputed forward pass the simulator counts.
    full = efficiency_from_calibration({**measured(0.05, 0.3), "config": {"remat_policy": "full"}},
                                       h200)
    assert full.train == pytest.approx(0.4)

    def step_s(eff):
        return search.plan(models, w, "h200", 8, host_roles=("reward",), efficiency=eff,
                            alternatives=0).best.iteration_s

    assert step_s(slow) > step_s(None) > step_s(fast)
    with pytest.raises(ValueError, match="calibration: update_mfu missing"):
        efficiency_from_calibration({k: v for k, v in measured(0.5, 0.5).items()
                                     if k != "update_mfu"}, h200)


def test_long_rows_bring_sequence_parallel_layouts():
    """With rows of LONG_ROWS tokens or more the planner also tries meshes that split rows over
    `sequence` (sizes Ulysses can split the heads by), which hold a quarter of a row's
    activations per device where fsdp=8 holds a whole row."""
    cfg = get_preset("qwen2.5-7b").replace(dtype="bfloat16", remat_policy="full")
    actor = ModelSpec("actor", cfg, "causal_lm", True)

    def layouts(response_len, micro):
        w = Workload(prompts=16, n=8, prompt_len=1024, response_len=response_len,
                     actor_mini=128, actor_micro=micro)
        sim = Simulator(cluster_for("h200"), w)
        return sim, search._Search({"actor": actor}, sim, 0.9 * 141e9).layouts("actor", 8)

    assert {lay.sequence for lay, _, _ in layouts(1024, 8)[1]} == {1}
    sim, long = layouts(32768, 2)
    # 4 kv heads: sequence 2 and 4 (not 8); micro-batches of 2 rows leave fsdp x data <= 2.
    assert {lay.sequence for lay, _, _ in long} == {1, 2, 4}
    assert "fsdp=2,sequence=4" in {lay.mesh for lay, _, _ in long}
    split = MeshLayout(fsdp=2, sequence=4)
    _, call = sim.train_call(actor, split)
    whole = sim.costs.call(actor, MeshLayout(fsdp=2, tensor=4), call).extra_bytes
    assert sim.costs.call(actor, split, call).extra_bytes < whole
    assert sim.ulysses(actor, split, 33792, 1) > 0 == sim.ulysses(actor, MeshLayout(fsdp=8),
                                                                  33792, 1)

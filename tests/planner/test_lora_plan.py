"""The planner with LoRA: the actor's state is its frozen base plus float32 adapters and their
Adam moments, the reference holds nothing of its own and is always placed with the actor."""

from configs import grpo_lora_llama70b
from hfjax.models.lora import adapter_bytes
from hfjax.planner.config import plan_inputs
from hfjax.planner.pricing import ClosedFormPrices, MeshLayout, param_shard_bytes
from hfjax.planner.search import plan


def test_lora_state_and_a_reference_that_shares_the_base():
    cfg = grpo_lora_llama70b.get_config()
    models, host, workload = plan_inputs(cfg)
    by = {m.role: m for m in models}
    actor, ref = by["actor"], by["ref"]
    assert actor.lora is not None and actor.lora.rank == 64
    assert ref.shares_base_of == "actor" and ref.lora is None
    lay = MeshLayout(fsdp=8, rules="nested_train")
    costs = ClosedFormPrices()
    assert costs.state(ref, lay).total == 0
    base = param_shard_bytes(actor, lay)
    adapters = -(-adapter_bytes(actor.config, actor.lora) // 8)
    got = costs.state(actor, lay)
    assert (got.params, got.optimizer) == (base + adapters, 2 * adapters)
    assert base > 40 * adapters  # a bf16 70B base against rank-64 float32 adapters

    full = cfg.copy_and_resolve_references()
    full.actor.lora.rank = 0
    full_models = {m.role: m for m in plan_inputs(full)[0]}
    assert costs.state(full_models["ref"], lay).total == base
    assert costs.state(full_models["actor"], lay).optimizer == 2 * base


def test_the_search_keeps_the_reference_with_the_actor():
    cfg = grpo_lora_llama70b.get_config()
    models, host, workload = plan_inputs(cfg)
    result = plan(models, workload, "h200", 8, host_roles=host)
    for p in [result.best, *result.alternatives]:
        assert any({"actor", "ref"} <= set(roles) for roles in p.placement_key)

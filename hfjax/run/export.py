"""A run's actor out of its checkpoint, and written as an HF directory or PEFT adapters
(`python -m launch.export`): `load_actor` restores it, on one device or across processes
sharded over the devices of all of them, and `export_hf` writes it."""

from __future__ import annotations

import os

import jax

from hfjax.run.checkpoint import RunCheckpointer, fingerprints, locate


def load_actor(ckpt: str, step: int | None = None):
    """(actor model, Restored) from a checkpoint, newest readable by default: on one device,
    or across processes sharded over the devices of all of them. A vision-language run's
    actor is a `qwen2_5_vl.VisionLM` of its language model (with a LoRA run's adapters) and
    its tower: the checkpoint's frozen one (`actor_vision`) or the one that trained."""
    from flax import nnx

    from hfjax.models import lora_export, qwen2_5_vl, transformer
    from hfjax.models.config import ModelConfig
    from hfjax.parallel import sharding as shd
    from hfjax.parallel.mesh import MeshSpec, sorted_devices

    root, at = locate(ckpt)
    graphdefs = {}

    def targets(state):
        cfg = ModelConfig(**state["model_config"])
        model, vision = transformer.abstract(cfg, "causal_lm"), {}
        if state.get("vision"):  # its language model trained; a frozen tower beside it
            vl = qwen2_5_vl.from_record(cfg, state["vision"]["config"])
            model, tower = qwen2_5_vl.policy(qwen2_5_vl.abstract(vl),
                                             state["vision"]["frozen"])
            if tower is not None:
                graphdefs["vision"], tstate = nnx.split(tower)
                vision = {"actor_vision": jax.tree.map(
                    _abstract_on, tstate, _placement(cfg)(tstate), is_leaf=shd.is_variable)}
        if state.get("lora"):  # a LoRA run: adapters, and the base if the run saved it
            return lora_export.targets(model, state["lora"], graphdefs,
                                       _placement(cfg)) | vision
        graphdef, abstract = nnx.split(model)
        graphdefs["actor"] = graphdef
        if jax.process_count() == 1:
            device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
            shardings = jax.tree.map(lambda _: device, abstract, is_leaf=shd.is_variable)
        else:
            # No process holds the whole model on its devices: FSDP over all of them, a
            # dimension that does not divide kept whole.
            mesh = MeshSpec.parse("fsdp=-1").build(sorted_devices())
            lay = shd.layout(mesh, "train", replicate_indivisible=tuple(shd.TRAIN_RULES))
            shardings = lay.state_shardings(abstract)

        return {"actor_params": jax.tree.map(_abstract_on, abstract, shardings,
                                             is_leaf=shd.is_variable)} | vision

    restored = RunCheckpointer(root, read_only=True).restore_latest(
        targets, step=step if step is not None else at)
    if restored.state.get("lora"):
        model = lora_export.model(restored, graphdefs, fingerprints)
    else:
        model = nnx.merge(graphdefs["actor"], restored.items["actor_params"])
    record = restored.state.get("vision")
    if record is None:
        return model, restored
    if record["frozen"]:
        tower = nnx.merge(graphdefs["vision"], restored.items["actor_vision"])
    else:  # it trained as the language model's own
        tower = model.visual
        del model.visual
    vl = qwen2_5_vl.from_record(model.config, record["config"])
    return qwen2_5_vl.VisionLM(vl, rngs=nnx.Rngs(0), lm=model, visual=tower), restored


def _abstract_on(var, sharding):
    """An nnx Variable's abstract value placed on `sharding` (a restore target)."""

    x = var.get_value()
    return var.replace(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding))


def _placement(cfg):
    """The sharding of every leaf of a restored actor (as `load_actor` places them)."""

    from hfjax.parallel import sharding as shd
    from hfjax.parallel.mesh import MeshSpec, sorted_devices

    if jax.process_count() == 1:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return lambda state: jax.tree.map(lambda _: device, state, is_leaf=shd.is_variable)
    mesh = MeshSpec.parse("fsdp=-1").build(sorted_devices())
    lay = shd.layout(mesh, "train", replicate_indivisible=tuple(shd.TRAIN_RULES))
    return lay.state_shardings


def export_hf(ckpt: str, out: str, step: int | None = None, tokenizer: str | None = None,
              fmt: str = "merged") -> str:
    """Writes the actor of a run's checkpoint (`load_actor`) to `out`; returns out.

    `fmt` "merged" (or "hf"): an HF directory with the run's tokenizer (`<out_dir>/tokenizer`,
    or `tokenizer`), a LoRA run's adapters merged into its weights. "peft" (LoRA runs only):
    PEFT's adapter_config.json + adapter_model.safetensors, naming the base by its path, or,
    when the run made its base (from scratch, a warm start), with the base written as an HF
    directory in `out/base` (`hfjax.models.lora_export`)."""
    import hfjax.models as M
    from hfjax.models import lora_export, qwen2_5_vl

    model, restored = load_actor(ckpt, step)
    vl = isinstance(model, qwen2_5_vl.VisionLM)
    root, _ = locate(ckpt)
    record = restored.state.get("lora")
    tok_path = tokenizer or os.path.join(os.path.dirname(root), "tokenizer")
    if not os.path.exists(tok_path):
        raise FileNotFoundError(f"no tokenizer at {tok_path}; pass --tokenizer=DIR")
    tok = M.load_tokenizer(tok_path)
    if fmt == "peft":
        if not record:
            raise ValueError(f"{ckpt}: the run trained full weights, it has no adapters to "
                             "write in PEFT's format; use --format=merged")
        return lora_export.save_peft(model, record, out, tok)
    if record:
        merged = lora_export.merged(model.lm if vl else model)
        model = qwen2_5_vl.VisionLM(model.config, rngs=None, lm=merged,
                                    visual=model.visual) if vl else merged
    if vl:
        if jax.process_count() > 1:
            raise ValueError("exporting a vision-language run runs in one process; drop the "
                             "process flags")
        return qwen2_5_vl.save_hf(model, out, tokenizer=tok)
    return M.save_hf(model, out, tokenizer=tok)

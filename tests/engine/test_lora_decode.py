"""LoRA and the 3D-HybridEngine: the bytes a rollout moves per step, merged vs unmerged.

Merged (what the actor does): the adapters are merged into a copy of the base on the training
mesh and the engine moves that copy to the decode layout; the copy is dropped after
generation, so the way back moves nothing and the training params never move. Unmerged
(measured, not used): the engine would move the base and the adapters to the decode layout
and back. Pinned on a small model, FSDP over 8 devices in the nested layout, decoding
`data=4,tensor=2`."""

import jax
from flax import nnx

from hfjax.engine.hybrid import HybridEngine
from hfjax.models import lora, transformer
from hfjax.models.config import ModelConfig
from hfjax.parallel import reshard
from hfjax.parallel import sharding as shd
from hfjax.parallel.mesh import MeshSpec

CFG = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16)
SPEC = lora.LoraSpec(rank=4, alpha=8.0)


def test_bytes_moved_per_step_merged_vs_unmerged():
    lay = shd.layout(MeshSpec.parse("fsdp=8").build(jax.devices()), "nested_train")
    model = transformer.abstract(CFG)
    base_engine = HybridEngine(lay, "data=4,tensor=2", nnx.state(model))
    lora.add_adapters(model, SPEC)
    full = nnx.state(model)
    full_engine = HybridEngine(lay, "data=4,tensor=2", full)

    merged = base_engine.bytes_to_decode()  # {device: bytes received}
    unmerged = full_engine.bytes_to_decode()
    assert sum(full_engine.bytes_to_train().values()) == 0  # the way back is a local slice
    # The base's share is the same either way; unmerged adds the adapters' own moves, which
    # a direct count over their leaves gives.
    leaves, _ = shd.flatten_state(full)
    paths = [jax.tree_util.keystr(p) for p, _ in
             jax.tree_util.tree_flatten_with_path(full, is_leaf=shd.is_variable)[0]]
    pick = [i for i, p in enumerate(paths) if "_lora_" in p]
    assert len(pick) == 2 * len(lora.TARGETS) and len(paths) == len(leaves)
    src, dst = full_engine.train_shardings(), full_engine.decode_shardings()
    adapter_moves = reshard.tree_transfer_bytes(
        [src[i] for i in pick], [dst[i] for i in pick], [leaves[i] for i in pick])
    assert unmerged == reshard.add(merged, adapter_moves)
    # Pinned (docs/algorithms.md, "LoRA").
    base_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(lora.base_state(full)))
    assert (max(merged.values()), max(adapter_moves.values()), base_bytes) == (
        208_896, 17_152, 427_264)

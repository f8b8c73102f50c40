"""Peak host RSS of loading SmolLM2-135M from GGUF onto an 8-device `fsdp=4,tensor=2` mesh.

Usage: python bench/load_rss.py
On CPU the devices' buffers live in host memory too, so the peak is: runtime baseline + the
sharded model (f32) + the loader's transient host copies. The loader streams one tensor at a
time, so the transient part should be about one tensor (the largest is the 49152 x 576
embedding, 113 MB in f32), not the model.
"""

import json
import resource

from hfjax.parallel.distributed import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8, keep_given=False)  # before JAX starts

import jax  # noqa: E402

import hfjax.models as M  # noqa: E402
from hfjax.models.smollm2 import smollm2_gguf_path  # noqa: E402
from hfjax.parallel.mesh import MeshSpec  # noqa: E402


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main():
    mesh = MeshSpec.parse("fsdp=4,tensor=2").build(jax.devices())
    jax.numpy.zeros(1).block_until_ready()
    base = rss_mb()
    model = M.load(str(smollm2_gguf_path()), mesh=mesh, replicate_indivisible=("kv_heads", "heads"))
    peak = rss_mb()
    model_mb = model.config.num_params() * 4 / 2**20
    largest_mb = model.config.vocab_size * model.config.hidden_size * 4 / 2**20
    print(json.dumps({
        "baseline_rss_mb": round(base, 1),
        "peak_rss_mb": round(peak, 1),
        "model_f32_mb": round(model_mb, 1),
        "largest_tensor_mb": round(largest_mb, 1),
        "transient_mb": round(peak - base - model_mb, 1),
    }))


if __name__ == "__main__":
    main()

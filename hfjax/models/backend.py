"""Every per-backend choice, made here and nowhere else, for an explicit target platform.

A program is compiled either for the devices it runs on, or (a dry run, the planner's
compiled prices) on CPU devices standing in for a target's GPUs or TPUs (`compiling_for`).
Each choice below takes the platform it is made for ("cpu", "gpu", "tpu"; default: the
`compiling_for` target, else the devices'), so that the programs a dry run prices are the
target's where this machine can compile them:

- `storage_dtype`: the dtype of attention's inputs and the KV cache (float32 for a 16-bit
  model on CPU only);
- `compute_dtype`: what `model.dtype=auto` resolves to (the CPU's bfloat16 units are read by
  `hfjax.models.precision`);
- `attention_impl`: the training, scoring and prefill attention (`model.attention_impl`);
- `decode_choice`: the decode step's cache read and cache layout (`rollout.decode_attention`,
  `rollout.kv_layout`);
- `fuse_projections`: whether the decode loop multiplies fused q/k/v and gate/up weights;
- `blocked_token_draw`: the sampler's inverse-CDF draw over the vocabulary, in one pass or two;
- `remat_policy`: what `model.remat_policy=auto` resolves to (the trainer, the dry run and the
  planner all call it).

Kernels that only the target has (cuDNN, splash, the Pallas decode read) cannot be compiled on
CPU: there they are replaced by a portable implementation of the same memory behaviour, with
one log line, and `stand_in()` is true. That, and XLA:CPU's own fusion decisions (its
temporaries), are what remains different between a dry run and the accelerator.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable

import jax
import jax.numpy as jnp
from absl import logging

from hfjax.models import precision
from hfjax.models.config import ATTENTION_IMPLS

PLATFORMS = ("cpu", "gpu", "tpu")
DECODE_ATTENTION = ("auto", "full", "chunked", "pallas")
KV_LAYOUTS = ("auto", "cpu", "gpu")
REMAT_POLICIES_AUTO = ("none", "full")  # what auto chooses between, lightest first

_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "hfjax_backend_target", default=None)


def canonical(platform: str) -> str:
    """"cpu", "gpu" or "tpu" for a JAX platform name ("cuda" and "rocm" are GPUs)."""
    return "gpu" if platform in ("cuda", "rocm", "gpu") else platform


@contextlib.contextmanager
def compiling_for(platform: str | None):
    """Within this context every choice here is made for `platform` ("cpu", "gpu", "tpu";
    None: the devices') instead of the devices' backend. The dry run and the planner's compiled
    prices compile a GPU or TPU target's programs on CPU devices under it."""
    token = _TARGET.set(canonical(platform) if platform else None)
    try:
        yield
    finally:
        _TARGET.reset(token)


def device_platform() -> str:
    """The backend programs run on here: "cpu", "gpu" or "tpu"."""
    return canonical(jax.default_backend())


def target_platform() -> str:
    """The platform choices are made for: the `compiling_for` target, else the devices'."""
    return _TARGET.get() or device_platform()


def stand_in() -> bool:
    """Whether programs are compiled on this machine for another platform (a dry run's target):
    kernels that only the target has are then replaced by portable ones of the same memory
    behaviour."""
    return target_platform() != device_platform()


def _platform(platform: str | None) -> str:
    return canonical(platform) if platform else target_platform()


_LOGGED: set[str] = set()


def log_once(message: str) -> None:
    if message not in _LOGGED:
        _LOGGED.add(message)
        logging.info(message)


# --- dtypes -------------------------------------------------------------------------------


def storage_dtype(dtype, platform: str | None = None) -> jnp.dtype:
    """The dtype in which a `dtype` model keeps its KV cache and computes attention (queries,
    keys, values, RoPE) on `platform` (default: `target_platform()`): `dtype`, except 16-bit
    floats on CPU, which are kept in float32.

    XLA:CPU has no 16-bit float arithmetic: it computes every bfloat16 element-wise op in
    float32 between a pair of conversions. A bfloat16 cache's slice update becomes the whole
    buffer converted to float32, updated and converted back (a copy of the cache per layer per
    write), and the attention products convert the cache to float32 again; in a training pass,
    RoPE and the attention gradients summed over the causal query blocks convert at every op
    (those fusions took ~15% of the bf16 actor update's op time). In float32 the cache is
    updated in place and the attention's element-wise work runs as it is; the projections
    still multiply in `dtype` (`matmul`). GPUs and TPUs keep the compute dtype, and so does a
    dry run for them compiled on CPU (under `compiling_for`): its caches and attention inputs
    are priced in the accelerator's bytes.
    """
    dtype = jnp.dtype(dtype)
    if (dtype.itemsize == 2 and jnp.issubdtype(dtype, jnp.floating)
            and _platform(platform) == "cpu"):
        return jnp.dtype(jnp.float32)
    return dtype


def compute_dtype(name: str, platform: str | None = None, hidden_size: int | None = None,
                  cpuinfo: str | None = None) -> str:
    """The compute dtype a config's `model.dtype` (`name`) asks for on `platform`: 'float32' or
    'bfloat16' as given; for 'auto', bfloat16 on GPUs and TPUs, and on a CPU with native
    bfloat16 multiplies (`cpuinfo`, default this host's: `hfjax.models.precision`) for a model
    of `hidden_size` >= BF16_MIN_HIDDEN; float32 otherwise (other CPUs emulate bfloat16 and gain
    nothing; a small model's many small ops and casts eat the matmuls' gain)."""
    if name not in precision.COMPUTE_DTYPES:
        raise ValueError(f"model.dtype={name!r}; use one of {', '.join(precision.COMPUTE_DTYPES)}")
    if name != "auto":
        return name
    target = _platform(platform)
    if target in ("gpu", "tpu"):
        return "bfloat16"
    if (target == "cpu" and hidden_size is not None and hidden_size >= precision.BF16_MIN_HIDDEN
            and precision.native_bf16_flags(cpuinfo)):
        return "bfloat16"
    return "float32"


# --- attention ----------------------------------------------------------------------------


def splash_module():
    try:
        from jax.experimental.pallas.ops.tpu.splash_attention import (
            splash_attention_kernel,
            splash_attention_mask,
        )
    except ImportError:  # a jax without the TPU Pallas kernels
        return None
    return splash_attention_kernel, splash_attention_mask


def cudnn_takes(dtype, head_dim: int) -> str | None:
    """Why cuDNN's fused attention cannot take q/k/v of `dtype` and `head_dim` (None: it can)."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"cuDNN flash attention needs bfloat16 or float16, not {jnp.dtype(dtype).name}"
    if head_dim % 8 or head_dim > 256:
        return f"cuDNN flash attention needs a head dim that is a multiple of 8 up to 256, " \
               f"not {head_dim}"
    return None


def attention_impl(impl: str, dtype, head_dim: int, platform: str | None = None) -> str:
    """The training / scoring / prefill attention `impl` stands for with q/k/v of `dtype` and
    `head_dim` on `platform`: "auto" is dense on CPU, blockwise on GPUs, splash on TPUs; a fused
    kernel that cannot run the case (or cannot run here: a dry run's stand-in) is replaced by
    "blockwise", with one log line saying why."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"model.attention_impl={impl!r}; choose one of {ATTENTION_IMPLS}")
    target = _platform(platform)
    if impl == "auto":
        # GPUs: blockwise, measured on an H200 (the GRPO update at 39% MFU, the default job);
        # "cudnn" is opt-in: there its programs did not finish compiling within 40 s at
        # 16 x 2048 columns (docs/benchmarks.md, "Decode on an H200").
        impl = {"cpu": "dense", "gpu": "blockwise", "tpu": "splash"}.get(target, "dense")
    if impl == "cudnn":
        why = cudnn_takes(dtype, head_dim)
        if why is None and device_platform() != "gpu":
            why = f"cuDNN runs on GPUs and programs are compiled on {device_platform()}"
        if why is not None:
            log_once(f"attention: {why}; using blockwise attention")
            return "blockwise"
    if impl == "splash":
        why = None
        if device_platform() != "tpu":
            why = f"splash attention runs on TPUs and programs are compiled on {device_platform()}"
        elif splash_module() is None:
            why = "jax.experimental.pallas.ops.tpu.splash_attention does not import"
        if why is not None:
            log_once(f"attention: {why}; using blockwise attention")
            return "blockwise"
    return impl


# --- decoding -----------------------------------------------------------------------------


def decode_choice(attention: str = "auto", layout: str = "auto", *, interpret: bool = False,
                  platform: str | None = None) -> tuple[str, str]:
    """(cache read, cache layout) for `rollout.decode_attention` and `rollout.kv_layout` on
    `platform`: "auto" is the full read and the "cpu" layout on CPU, the Pallas read and the
    "gpu" layout on GPUs, the full read and the "gpu" layout on TPUs. "pallas" where the kernel
    cannot run (no GPU, and not `interpret`: a dry run for a GPU target compiled on CPU)
    becomes "chunked", with a log line.
    Raises ValueError for an unknown choice or "pallas" with the "cpu" layout."""
    if attention not in DECODE_ATTENTION:
        raise ValueError(f"rollout.decode_attention={attention!r}; choose one of "
                         f"{DECODE_ATTENTION}")
    if layout not in KV_LAYOUTS:
        raise ValueError(f"rollout.kv_layout={layout!r}; choose one of {KV_LAYOUTS}")
    target = _platform(platform)
    if layout == "auto":
        layout = "cpu" if target == "cpu" else "gpu"
    if attention == "auto":
        # Measured on an H200 (Qwen2.5-1.5B, 512 rows, 32 + 256 columns; docs/benchmarks.md,
        # "Decode on an H200"): Pallas 5.98 ms per step, full read 7.25, chunked 8.97. TPUs
        # have no Pallas decode read here yet, and the chunked loop did not pay on the GPU.
        attention = "pallas" if target == "gpu" else "full"
    if attention == "pallas":
        if layout != "gpu":
            raise ValueError("rollout.decode_attention=pallas reads the 'gpu' cache layout; "
                             "set rollout.kv_layout=gpu (or auto on a GPU)")
        if device_platform() != "gpu" and not interpret:
            log_once(f"decode: the Pallas decode-attention kernel runs on GPUs and programs "
                      f"are compiled on {device_platform()}; using the chunked read")
            attention = "chunked"
    return attention, layout


def fuse_projections(tensor: int = 1, platform: str | None = None) -> bool:
    """Whether the decode loop multiplies each layer's q/k/v and gate/up weights fused into one
    matrix: on GPUs and TPUs, where the decode layout has no `tensor` axis (size `tensor`) to
    split them over.

    XLA's GPU compiler merges dots that share an operand (x @ Wq, x @ Wk, x @ Wv) into one dot
    over concatenated weights, and inside the decode loop it concatenates those weights again
    on every step: on an H200 (Qwen2.5-1.5B, 512 rows) those copies took 23% of the decode
    loop's device time (docs/benchmarks.md, "Decode on an H200"). Concatenated once per rollout,
    the loop runs the merged matmuls on weights that are already whole. On a tensor axis the
    concatenation would have to move shards between devices, and on CPU the separate matmuls
    are what XLA:CPU runs well, so both keep the separate weights."""
    return _platform(platform) != "cpu" and tensor == 1


def blocked_token_draw(platform: str | None = None) -> bool:
    """Whether the sampler draws tokens by the two-level inverse CDF
    (`hfjax.engine.token_select.blocked_inverse_cdf`) rather than one cumulative sum over the
    vocabulary: the vocabulary-wide cumulative sum is cheap on CPU and a slow pass on
    accelerators."""
    return _platform(platform) != "cpu"


def blocked_grouped_matmul(platform: str | None = None) -> bool:
    """Whether dropless dispatch multiplies each expert's rows in fixed blocks of rows, every
    block one expert's (`hfjax.models.moe.blocked_experts`), rather than by
    `jax.lax.ragged_dot`: on CPU. XLA lowers ragged_dot to a grouped GEMM on GPUs and TPUs;
    XLA:CPU expands it into a masked product per expert (E times the active FLOPs), which the
    blocks beat 3.5-4.2x there (bench/moe.py, docs/benchmarks.md). Both are dropless and
    compute the same sums."""
    return _platform(platform) == "cpu"


# --- recomputation ------------------------------------------------------------------------

# `model.remat_policy=auto` keeps every activation when the run's peak without recomputation
# stays under this share of the device memory (the rest is the runtime's and the compiler's
# margin: XLA:CPU's temporaries stand in for the accelerator's), else checkpoints every layer.
REMAT_HEADROOM = 0.9


def remat_policy(policy: str, device_memory_bytes: int | None = None,
                 peak_without: Callable[[], int] | None = None) -> str:
    """What `model.remat_policy` = `policy` resolves to (a policy other than "auto" is itself).

    For "auto": "none" when no device memory is known (nothing to fit: CPU devices) or when
    `peak_without()` (the run's peak per device without recomputation, from its dry run) stays
    under REMAT_HEADROOM of `device_memory_bytes`; else "full" (per-layer checkpointing).
    Without `peak_without` (a plan, which prices programs without compiling the run) auto is
    "full", the policy it falls back to where memory is tight, so that the plan's memory
    verdict holds for either outcome."""
    if policy != "auto":
        return policy
    none, full = REMAT_POLICIES_AUTO
    if peak_without is None:
        return full
    if not device_memory_bytes:
        return none
    return none if peak_without() <= REMAT_HEADROOM * device_memory_bytes else full


# --- what a stand-in compilation still differs in -----------------------------------------

_STAND_INS = {
    "gpu": "cuDNN attention (opt-in) and the Pallas decode read compiled as blockwise attention "
           "and the chunked read (the same memory behaviour)",
    "tpu": "splash attention compiled as blockwise attention (the same memory behaviour)",
}


def stand_in_differences(platform: str) -> str:
    """One line saying how programs compiled here for `platform` differ from the ones the
    target compiles itself (empty when this machine is that platform): the dtypes are the
    target's, the compiler and the target-only kernels are not."""
    target, here = canonical(platform), device_platform()
    if target == here:
        return ""
    kernels = _STAND_INS.get(target)
    kept = "float32" if target == "cpu" else "its 16-bit dtype"
    return (f"compiled by XLA:{here.upper()} for {target}: dtypes are the {target}'s (a 16-bit "
            f"model's attention inputs and KV caches in {kept}); temporaries are "
            f"XLA:{here.upper()}'s (it computes 16-bit element-wise work in float32)"
            + (f"; {kernels}" if kernels else ""))


# --- mixture of experts -------------------------------------------------------------------

MOE_IMPLS = ("auto", "ragged", "capacity")


def moe_impl(impl: str = "auto", platform: str | None = None) -> str:
    """The expert dispatch `model.moe_impl` stands for (`hfjax.models.moe`): "auto" is the
    dropless grouped matmul ("ragged": `jax.lax.ragged_dot`, or blocks of rows on CPU,
    `blocked_grouped_matmul`) on every platform; "capacity" (fixed per-expert buffers, overflow
    dropped) only when asked: dropping tokens changes the model."""
    if impl not in MOE_IMPLS:
        raise ValueError(f"model.moe_impl={impl!r}; choose one of {MOE_IMPLS}")
    del platform  # one answer everywhere today; the argument keeps the module's convention
    return "ragged" if impl == "auto" else impl

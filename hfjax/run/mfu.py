"""Model FLOPs utilisation of a step's stages: the model's FLOPs over the stage's wall time and
the devices' peak.

FLOPs follow the planner's count (`hfjax.models.flops`): per token and layer 2W for the
matmul weights plus 4·heads·head_dim·context for attention, plus the LM head on response
tokens; a training pass is 3 forward passes (forward and backward, the 6N convention: a
recomputed forward under remat is not useful work and is not counted), a scoring pass is 1.
Tokens are the step's real ones (the attention mask), each attending over its row's mean real
length. The peak is the dense bf16 figure of the device kind (`targets.peak_flops`); on a
device without one (CPU) no MFU is reported.
"""

from __future__ import annotations

from hfjax.models.config import ModelConfig
from hfjax.models.flops import head_flops, layers_flops


def forward_flops(cfg: ModelConfig, rows: int, tokens: float, response_tokens: float) -> float:
    """FLOPs of one forward pass over `rows` rows holding `tokens` real tokens in all, the LM
    head on `response_tokens` of them."""
    if rows <= 0 or tokens <= 0:
        return 0.0
    length = tokens / rows
    return (layers_flops(cfg, rows, length, length)
            + head_flops(cfg, "causal_lm", rows, length, response_tokens / rows))


def stage_mfu(flops: float, seconds: float, devices: int, peak: float | None) -> float | None:
    """flops / (seconds x devices x peak), or None without a peak or a time."""
    if not peak or seconds <= 0 or devices <= 0:
        return None
    return flops / (seconds * devices * peak)


def step_mfu(cfg: ModelConfig, timing: dict[str, float], *, rows: int, tokens: float,
             response_tokens: float, epochs: int, actor_devices: int, ref_devices: int,
             peak: float | None) -> dict[str, float]:
    """verl's `perf/mfu/actor` (the actor update: 3 passes per epoch) and `perf/mfu/ref` (the
    reference's scoring pass), from the stages' times `timing_s/update_actor` and
    `timing_s/ref`; a stage that did not run, or no peak, gives no entry."""
    fwd = forward_flops(cfg, rows, tokens, response_tokens)
    out = {}
    for key, stage, flops, devices in (
            ("perf/mfu/actor", "timing_s/update_actor", 3 * epochs * fwd, actor_devices),
            ("perf/mfu/ref", "timing_s/ref", fwd, ref_devices)):
        if stage in timing:
            mfu = stage_mfu(flops, timing[stage], devices, peak)
            if mfu is not None:
                out[key] = mfu
    return out

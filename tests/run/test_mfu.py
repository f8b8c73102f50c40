"""perf/mfu/*: the model's FLOPs per stage, written out here per layer and per token, over the
stage's time and the device kind's peak."""

import math

import pytest

from hfjax.models.presets import get_preset
from hfjax.parallel import targets
from hfjax.run import mfu


def test_peaks_by_device_kind():
    assert targets.peak_flops("NVIDIA H200") == 989.5e12
    assert targets.peak_flops("NVIDIA H100 80GB HBM3") == 989.5e12
    assert targets.peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert targets.peak_flops("TPU v5 lite") == 197e12
    assert targets.peak_flops("TPU v5p") == 459e12
    assert targets.peak_flops("TPU v4") == 275e12
    assert targets.peak_flops("TPU v6 lite") == 918e12
    assert targets.peak_flops("cpu") is None


def test_step_mfu_counts_six_n_plus_attention_over_the_stage_time():
    cfg = get_preset("qwen2.5-1.5b")
    rows, length, response = 8, 96, 64
    d, L, N, K, H, F, V = (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
                           cfg.head_dim, cfg.intermediate_size, cfg.vocab_size)
    fwd = 0.0
    for _ in range(rows):
        for _ in range(length):
            for _ in range(L):
                weights = d * H * (2 * N + 2 * K) + 3 * d * F
                fwd += 2 * weights + 4 * N * H * length
        fwd += 2 * d * V * response
    assert mfu.forward_flops(cfg, rows, rows * length, rows * response) == pytest.approx(fwd)
    timing = {"timing_s/update_actor": 2.0, "timing_s/ref": 0.5, "timing_s/gen": 9.0}
    got = mfu.step_mfu(cfg, timing, rows=rows, tokens=rows * length,
                       response_tokens=rows * response, epochs=2, actor_devices=4,
                       ref_devices=2, peak=1e12)
    assert got["perf/mfu/actor"] == pytest.approx(3 * 2 * fwd / (2.0 * 4 * 1e12))
    assert got["perf/mfu/ref"] == pytest.approx(fwd / (0.5 * 2 * 1e12))
    assert all(math.isfinite(v) and v > 0 for v in got.values())
    # No peak (CPU) or a stage that did not run: no entry.
    assert mfu.step_mfu(cfg, timing, rows=rows, tokens=1.0, response_tokens=1.0, epochs=1,
                        actor_devices=1, ref_devices=1, peak=None) == {}
    assert set(mfu.step_mfu(cfg, {"timing_s/ref": 1.0}, rows=rows, tokens=1.0,
                            response_tokens=1.0, epochs=1, actor_devices=1, ref_devices=1,
                            peak=1e12)) == {"perf/mfu/ref"}


@pytest.mark.slow  # builds a trainer and runs two GRPO steps: about 20 s on 2 cores
def test_trainer_reports_mfu_where_the_device_has_a_peak(tmp_path):
    from support import tiny_rl_config

    from hfjax.run.trainer import Trainer

    # The actor and the reference on pools of different sizes (4 and 2 devices), so that
    # each stage's figure must use its own role's device count.
    c = tiny_rl_config(algorithm="grpo", out_dir=tmp_path,
                       placement="act=4:actor+reward;score=2:ref")
    c.rollout.n = 2
    c.actor.use_kl_loss = True  # the step runs the reference's scoring pass
    c.algo.adv_estimator = "grpo"
    trainer = Trainer(c)
    assert trainer._peak is None  # a CPU: no MFU
    assert not any(k.startswith("perf/mfu/") for k in trainer.train_step())
    trainer._peak = 1e12  # as a device kind with a table peak would give
    m = trainer.train_step()
    for key, stage in (("perf/mfu/actor", "timing_s/update_actor"),
                       ("perf/mfu/ref", "timing_s/ref")):
        assert 0 < m[key] < 1 and stage in m
    # The actor's figure is its update's FLOPs over that stage's time on the actor's devices.
    actor_devices = trainer.workers.actor.mesh.devices.size
    ref_devices = trainer.workers.ref.mesh.devices.size
    assert (actor_devices, ref_devices) == (4, 2)
    fwd = mfu.forward_flops(trainer.model_cfg, 16 * 2, m["perf/total_num_tokens"],
                            m["response_length/mean"] * 16 * 2)
    assert m["perf/mfu/actor"] * m["timing_s/update_actor"] * actor_devices * 1e12 == (
        pytest.approx(3 * fwd))
    # The reference's figure: one forward pass over its stage's time on the reference's devices.
    assert m["perf/mfu/ref"] * m["timing_s/ref"] * ref_devices * 1e12 == pytest.approx(fwd)

"""Checkpoints in process, on 8 CPU devices: restore onto another mesh or placement, fall back
past a corrupt or partial latest checkpoint (with a warning naming it), refuse a checkpoint of
another model, and keep a killed save from counting as a step.

Trainers here never compile an RL step: their states are filled with random values (each leaf
keeps its sharding) and saved, which is all that save and restore see.
"""

import gc
import logging
import os
import shutil

import chex
import jax
import numpy as np
import pytest
from flax import nnx
from support import tiny_rl_config

from hfjax.run import checkpoint as ck
from hfjax.run.trainer import Trainer

# A failed read leaves Orbax's pending read coroutines to be collected unfinished; harmless.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def tiny_config(out_dir, mesh="fsdp=-1", placement="colocate", hidden=32):
    c = tiny_rl_config(placement=placement, mesh=mesh, out_dir=out_dir, hidden=hidden)
    c.model.num_kv_heads = 2  # kv heads split by tensor=2 meshes
    c.algo.kl_ctrl.type = "adaptive"  # the controller state worth round-tripping
    return c


def host_leaves(trainer) -> dict[str, np.ndarray]:
    items = trainer.checkpoint_items()
    with jax.transfer_guard("allow"):
        return {f"{item}/{k}": np.asarray(jax.device_get(v))
                for item, tree in items.items() for k, v in ck.named_leaves(tree).items()}


def scramble(trainer, seed: int, step: int) -> None:
    """Random values in every array (same shapes and shardings) and a moved host state."""
    rng = np.random.default_rng(seed)

    def fill(x):
        if np.issubdtype(x.dtype, np.floating):
            v = rng.normal(size=x.shape).astype(x.dtype)
        else:
            v = rng.integers(0, 1000, size=x.shape).astype(x.dtype)
        with jax.transfer_guard("allow"):
            return jax.device_put(v, x.sharding)

    items = jax.tree.map(fill, trainer.checkpoint_items())
    state = trainer.state_dict()
    state["step"] = step
    state["data"]["cursor"] = 16 * step
    state["kl_ctrl"]["value"] = 0.001 * (1 + step)
    state["train_calls"] = {"actor": step, "critic": step}
    trainer.load_state(ck.Restored(step=step, items=items, state=state, config={}))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A run saved on fsdp=4,tensor=2 at steps 2 and 4, with the leaves of each."""
    out = tmp_path_factory.mktemp("saved")
    t = Trainer(tiny_config(out, mesh="fsdp=4,tensor=2"))
    ckpt = ck.RunCheckpointer(str(out / "checkpoints"), max_to_keep=3)
    leaves = {}
    for step in (2, 4):
        scramble(t, seed=step, step=step)
        t.save(ckpt)
        ckpt.wait()
        leaves[step] = host_leaves(t)
    ckpt.close()
    return out, leaves


def _copy(saved, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(saved[0], dst)
    return dst


@pytest.mark.parametrize("placement,mesh", [("colocate", "fsdp=8"), ("split", "fsdp=-1"),
                                            ("colocate", "fsdp=2,tensor=2,data=2")])
def test_restore_onto_another_mesh_and_placement(saved, tmp_path, placement, mesh):
    t = Trainer(tiny_config(tmp_path, mesh=mesh, placement=placement))
    restored = t.resume(None, str(saved[0]))  # a path: the newest checkpoint of that run
    assert restored.step == 4 and t.step == 4
    chex.assert_trees_all_equal(host_leaves(t), saved[1][4], strict=True)
    w = t.workers
    for group in (w.actor, w.ref, w.critic):
        for x in jax.tree.leaves(group.params):
            assert x.sharding.mesh == group.mesh  # this run's layout, not the saved one
    if placement == "split":
        actor_devs = set(w.actor.mesh.devices.flat)
        assert actor_devs.isdisjoint(w.critic.mesh.devices.flat)
        assert len(actor_devs) == 4
    assert t.train_iter.cursor == 64 and t.workers.kl_ctrl.value == pytest.approx(0.005)
    assert t.actor._train_calls == 4


def _largest_file(d):
    files = [os.path.join(r, f) for r, _, fs in os.walk(d) for f in fs]
    return max(files, key=os.path.getsize)


@pytest.mark.parametrize("damage", ["truncate_data", "delete_data", "delete_trainer_json",
                                    "truncate_trainer_json"])
def test_corrupt_latest_falls_back_with_a_warning(saved, tmp_path, caplog, damage):
    run = _copy(saved, tmp_path)
    step4 = run / "checkpoints" / "4"
    if damage.endswith("data"):
        # The array data that a restore reads: the item's merged OCDBT store under d/ (the
        # per-process stores under ocdbt.process_0/ were merged into it and are not read).
        target = _largest_file(step4 / "critic_opt_state" / "d")
    else:
        target = str(step4 / "trainer" / "metadata")
    if damage.startswith("truncate"):
        with open(target, "r+b") as f:
            f.truncate(os.path.getsize(target) // 2)
    else:
        os.remove(target)
    t = Trainer(tiny_config(tmp_path / "new", mesh="fsdp=8"))
    ckpt = ck.RunCheckpointer(str(run / "checkpoints"))
    with caplog.at_level(logging.WARNING):
        restored = t.resume(ckpt, "auto")
    assert restored.step == 2 and restored.skipped == [str(step4)]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any(str(step4) in m and "corrupt" in m for m in warnings), warnings
    chex.assert_trees_all_equal(host_leaves(t), saved[1][2], strict=True)
    # The bad step is moved aside, so the run can save step 4 again.
    assert ckpt.steps() == [2]
    assert any(n.startswith("4-") for n in os.listdir(str(run / "checkpoints") + ".corrupt"))
    ckpt.close()
    # The abandoned restore's other failed reads, once collected, report nothing more.
    with caplog.at_level(logging.DEBUG):
        gc.collect()
    late = [r.getMessage() for r in caplog.records if "never retrieved" in r.getMessage()]
    assert not late, late[0]


def test_late_reports_of_an_abandoned_restore_are_dropped_and_nothing_else():
    """Both forms in which asyncio reports an abandoned restore's unawaited reads (seen when a
    later test's collection ran them) are dropped; other asyncio errors are not."""
    drop = ck._AbandonedReadFilter()

    def record(message):
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, message, None, None)

    task = "Task exception was never retrieved\nfuture: <Task finished coro=<deserialize()>>"
    future = ("Future exception was never retrieved\nfuture: <Future finished exception="
              "ValueError('OUT_OF_RANGE: Error reading ... [tensorstore_spec=...]')>")
    assert not drop.filter(record(task)) and not drop.filter(record(future))
    assert drop.filter(record("Future exception was never retrieved\nfuture: <Future "
                              "finished exception=KeyError('mine')>"))
    assert drop.filter(record("Unclosed client session"))


def test_every_damaged_file_is_detected_or_harmless(saved, tmp_path):
    """Truncating any one file of a checkpoint either makes the restore fall back, or leaves
    what it restores exactly as saved: never silently wrong values."""
    src = saved[0] / "checkpoints" / "4"
    files = sorted(os.path.relpath(os.path.join(r, f), src)
                   for r, _, fs in os.walk(src) for f in fs)
    # Every file of two array items (the others are laid out alike) and all the rest.
    files = [f for f in files if not f.startswith(("ref_params/", "critic_params/",
                                                   "actor_opt_state/"))]
    t = Trainer(tiny_config(tmp_path / "new"))
    detected = set()
    for rel in files:
        run = tmp_path / "damaged"
        shutil.rmtree(run, ignore_errors=True)
        shutil.copytree(saved[0], run)
        path = run / "checkpoints" / "4" / rel
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
        ckpt = ck.RunCheckpointer(str(run / "checkpoints"), read_only=True)
        try:
            restored = ckpt.restore_latest(t.checkpoint_items())
        finally:
            ckpt.close()
        if restored.step == 2:
            detected.add(rel)
            continue
        assert restored.step == 4
        for item, tree in restored.items.items():
            for k, v in ck.named_leaves(tree).items():
                with jax.transfer_guard("allow"):
                    np.testing.assert_array_equal(np.asarray(v), saved[1][4][f"{item}/{k}"],
                                                  err_msg=f"{rel}: {item}/{k}")
    # The files a restore reads must all be caught. Harmless ones: commit markers, the sharding
    # file (a restore uses the target shardings), Orbax's step metadata, and each process's
    # OCDBT files, which the save merges into the item's own manifest and data files (how many
    # there are varies from save to save).
    read = [f for f in files
            if "ocdbt.process_" not in f
            and not f.endswith(("commit_success.txt", "_sharding", "_CHECKPOINT_METADATA"))]
    assert len(read) >= 8, read
    assert sorted(set(read) - detected) == [], "damaged but not detected"


def test_killed_save_is_not_a_step(saved, tmp_path):
    run = _copy(saved, tmp_path)
    # What a save killed half way leaves: a temporary directory that Orbax never renamed.
    shutil.copytree(run / "checkpoints" / "4", run / "checkpoints" / "6.orbax-checkpoint-tmp")
    ckpt = ck.RunCheckpointer(str(run / "checkpoints"), read_only=True)
    assert ckpt.steps() == [2, 4]
    t = Trainer(tiny_config(tmp_path / "new"))
    assert ckpt.restore_latest(t.checkpoint_items()).step == 4
    ckpt.close()


def test_checkpoint_of_another_model_is_refused_not_skipped(saved, tmp_path):
    t = Trainer(tiny_config(tmp_path, hidden=64))
    ckpt = ck.RunCheckpointer(str(saved[0] / "checkpoints"), read_only=True)
    with pytest.raises(ck.CheckpointMismatch, match="another model config"):
        t.resume(ckpt, "auto")
    ckpt.close()


def test_resume_disable_refuses_a_directory_with_checkpoints(saved, tmp_path):
    t = Trainer(tiny_config(tmp_path))
    ckpt = ck.RunCheckpointer(str(saved[0] / "checkpoints"), read_only=True)
    with pytest.raises(ValueError, match="resume=disable"):
        t.resume(ckpt, "disable")
    ckpt.close()


def test_explicit_step_and_export_loader(saved):
    from hfjax.run.export import load_actor

    model, restored = load_actor(str(saved[0] / "checkpoints" / "2"))
    assert restored.step == 2
    leaves = ck.named_leaves(nnx.state(model))
    assert len(leaves) == len([k for k in saved[1][2] if k.startswith("actor_params/")])
    for k, v in leaves.items():
        np.testing.assert_array_equal(np.asarray(v), saved[1][2][f"actor_params/{k}"], err_msg=k)


def test_fingerprint_sees_single_element_changes():
    x = jax.numpy.arange(1000, dtype=jax.numpy.float32)
    base = ck.fingerprints({"x": x})["x"]
    assert ck.fingerprints({"x": x.at[517].set(517.0001)})["x"] != base
    assert ck.fingerprints({"x": x.at[3].set(0.0)})["x"] != base
    assert ck.fingerprints({"x": x[::-1]})["x"] != base
    sharded = jax.device_put(x, jax.sharding.NamedSharding(
        jax.sharding.Mesh(np.array(jax.devices()), ("d",)), jax.sharding.PartitionSpec("d")))
    assert ck.fingerprints({"x": sharded})["x"] == base


@pytest.mark.parametrize("where", ["array", "state"])
def test_a_checkpoint_is_never_written_with_non_finite_values(tmp_path, where):
    mgr = ck.RunCheckpointer(str(tmp_path / "checkpoints"), async_save=False)
    w = jax.numpy.ones((4, 3), jax.numpy.float32)
    state = {"step": 1, "kl": 0.1}
    if where == "array":
        w = w.at[2, 1].set(jax.numpy.inf)
    else:
        state["kl"] = float("nan")
    match = (r"actor_params/layer.w holds NaN or infinity" if where == "array"
             else r"trainer state or config of step 1 holds NaN or infinity")
    with pytest.raises(ck.NonFiniteCheckpoint, match=match):
        mgr.save(1, {"actor_params": {"layer": {"w": w}}}, state, {"algorithm": "ppo"})
    mgr.wait()
    assert mgr.steps() == [] and not [p for p in os.listdir(mgr.directory) if p.startswith("1")]
    mgr.close()


def test_stop_during_the_warm_start_saves_nothing(tmp_path):
    c = tiny_config(tmp_path)
    c.sft.steps = 5
    ckpt = ck.RunCheckpointer(str(tmp_path / "checkpoints"))
    result = Trainer(c).fit(ckpt, should_stop=lambda: True)
    assert result.preempted and result.step == 0 and result.resumed_from is None
    assert ckpt.steps() == []
    assert (tmp_path / "tokenizer" / "tokenizer.json").exists()
    ckpt.close()


@pytest.mark.parametrize("key,value,match", [
    ("logger", "console,tensorbored", "unknown sink"),
    ("resume", "/no/such/run", "not auto, disable or an existing checkpoint directory"),
])
def test_bad_run_keys_fail_before_anything_is_built(tmp_path, key, value, match):
    c = tiny_config(tmp_path)
    setattr(c.trainer, key, value)
    with pytest.raises(ValueError, match=match):
        Trainer(c)

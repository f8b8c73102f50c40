"""Joining processes with jax.distributed: settings, real multi-process runs, lost processes.

The multi-process tests start real processes on 127.0.0.1 (CPU devices, gloo collectives):
through launch.local_cluster, or directly with the process flags.
"""

import os
import random
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from ml_collections import config_dict

from hfjax.parallel import distributed as dist
from hfjax.parallel import lost_process
from hfjax.parallel.distributed import DistributedError, Topology, resolve_settings
from launch import local_cluster

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The worker's module name, whole, ships its file with this test in the Bazel build.
WORKER_MODULE = "dist_worker"
WORKER = os.path.join(ROOT, "tests", "parallel", f"{WORKER_MODULE}.py")
LAUNCHER_ENV = {
    dist.ENV_COORDINATOR: "127.0.0.1:1234",
    dist.ENV_NUM_PROCESSES: "2",
    dist.ENV_PROCESS_ID: "1",
    dist.ENV_LAUNCHER: "launch.local_cluster",
}


# --- settings: validation before anything starts -------------------------------------------


def test_no_flags_no_launcher_no_cluster_is_one_process():
    s = resolve_settings(environ={})
    assert s.source == "single process" and not s.distributed
    assert s.cpu_devices == 1


def test_flags_give_the_run():
    s = resolve_settings(coordinator_address="10.0.0.1:1234", num_processes=4, process_id=3,
                         environ={})
    assert (s.source, s.coordinator_address, s.num_processes, s.process_id) == (
        "flags", "10.0.0.1:1234", 4, 3)


def test_launcher_environment_gives_the_run():
    s = resolve_settings(environ={**LAUNCHER_ENV, dist.ENV_CPU_DEVICES: "4"})
    assert (s.source, s.num_processes, s.process_id, s.cpu_devices) == (
        "launch.local_cluster", 2, 1, 4)


@pytest.mark.parametrize("kw, match", [
    (dict(coordinator_address="h:1", num_processes=2, process_id=2),
     r"^--process_id=2 is out of range for --num_processes=2; process ids are 0\.\.1"),
    (dict(coordinator_address="h:1", num_processes=2, process_id=-1), r"--process_id=-1 is out"),
    (dict(coordinator_address="h:1", num_processes=0, process_id=0), r"--num_processes=0; a run"),
    (dict(num_processes=2, process_id=1), r"also needs --coordinator_address"),
    (dict(coordinator_address="h:1"), r"also needs --num_processes and --process_id"),
    (dict(coordinator_address="localhost", num_processes=2, process_id=0), r"not host:port"),
    (dict(coordinator_address="h:99999", num_processes=2, process_id=0), r"not host:port"),
    (dict(cpu_devices=-1), r"--cpu_devices=-1"),
    (dict(heartbeat_timeout_s=0), r"--heartbeat_timeout_s=0; give a positive"),
])
def test_bad_flags_are_refused_in_one_line(kw, match):
    with pytest.raises(DistributedError, match=match) as err:
        resolve_settings(environ={}, **kw)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("kw, match", [
    (dict(num_processes=3),
     r"--num_processes=3 disagrees with the launcher: launch.local_cluster started 2"),
    (dict(process_id=0), r"--process_id=0 disagrees with the launcher: launch.local_cluster made"),
    (dict(coordinator_address="10.0.0.9:5"), r"disagrees with launch.local_cluster"),
    (dict(cpu_devices=8, environ_extra={dist.ENV_CPU_DEVICES: "4"}), r"--cpu_devices=8 disagrees"),
    (dict(environ_drop=dist.ENV_PROCESS_ID), r"but not HFJAX_PROCESS_ID"),
])
def test_flags_that_contradict_the_launcher_are_refused(kw, match):
    environ = {**LAUNCHER_ENV, **kw.pop("environ_extra", {})}
    environ.pop(kw.pop("environ_drop", None), None)
    with pytest.raises(DistributedError, match=match):
        resolve_settings(environ=environ, **kw)


def test_flags_that_contradict_a_detected_cluster_are_refused():
    s = resolve_settings(environ={}, cluster=("Slurm", 4, 2), num_processes=4)
    assert (s.source, s.num_processes, s.process_id, s.coordinator_address) == (
        "Slurm", 4, 2, None)
    with pytest.raises(DistributedError, match=r"--num_processes=2 disagrees .*Slurm runs 4"):
        resolve_settings(environ={}, cluster=("Slurm", 4, 2), num_processes=2)


def test_cpu_devices_leave_an_explicit_xla_flags_count_alone():
    xla = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    assert resolve_settings(environ=xla).cpu_devices == 0
    assert resolve_settings(environ=xla, cpu_devices=2).cpu_devices == 2


# --- meshes against the devices of all processes -------------------------------------------

TWO_BY_FOUR = Topology(process_id=0, num_processes=2, local_devices=4, total_devices=8,
                       platform="cpu", coordinator_address="127.0.0.1:1", source="flags")


def test_mesh_that_needs_more_devices_than_all_processes_have():
    dist.check_mesh_fits("fsdp=4,tensor=2", topo=TWO_BY_FOUR)
    dist.check_mesh_fits("fsdp=-1,tensor=8", topo=TWO_BY_FOUR)
    with pytest.raises(DistributedError, match=r"mesh 'fsdp=8,tensor=2' needs 16 devices, the "
                       r"run has 8 cpu devices \(2 processes x 4\)"):
        dist.check_mesh_fits("fsdp=8,tensor=2", topo=TWO_BY_FOUR)
    cfg = config_dict.ConfigDict({"actor": {"mesh": "fsdp=4"}, "rollout": {"mesh": ""},
                                  "critic": {"mesh": "data=2,tensor=8"}})
    with pytest.raises(DistributedError, match=r"config.critic.mesh 'data=2,tensor=8' needs 16"):
        dist.check_config_meshes(cfg, TWO_BY_FOUR)


def test_exit_status_counts_signals_as_the_shell_does():
    assert local_cluster.exit_status(0) == 0
    assert local_cluster.exit_status(3) == 3
    assert local_cluster.exit_status(-signal.SIGKILL) == 137
    assert "SIGKILL" in local_cluster.describe_status(-signal.SIGKILL)


# --- real processes ------------------------------------------------------------------------


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _launch(*args, timeout=120):
    """Runs launch.local_cluster; returns (exit status, output)."""
    cmd = [sys.executable, "-m", "launch.local_cluster", *args]
    r = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=timeout)
    return r.returncode, r.stdout + r.stderr


def _worker(*args, **popen):
    popen.setdefault("env", _env())
    return subprocess.Popen([sys.executable, "-u", WORKER, *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)


def test_two_processes_equal_one(tmp_path):
    """2 processes x 4 devices: one mesh over all 8, inputs fed per process and per device, a
    sharded matmul gathered back; the same program in 1 process x 8 devices."""
    code, out = _launch("--num_processes=2", "--devices_per_process=4", f"--script={WORKER}",
                        "--", "--job=matmul", "--mesh=fsdp=2,tensor=4", f"--out={tmp_path}/2.npz")
    assert code == 0, out
    assert "[0] process 0: 8 cpu devices (2 processes x 4)" in out
    assert "[1] process 1: 8 cpu devices (2 processes x 4)" in out
    one = subprocess.run([sys.executable, WORKER, "--job=matmul", "--cpu_devices=8",
                          "--mesh=fsdp=2,tensor=4", f"--out={tmp_path}/1.npz"],
                         cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert one.returncode == 0, one.stdout + one.stderr
    two, single = np.load(tmp_path / "2.npz"), np.load(tmp_path / "1.npz")
    rng = np.random.default_rng(7)
    x = rng.standard_normal((64, 96), dtype=np.float32)
    w = rng.standard_normal((96, 40), dtype=np.float32)
    np.testing.assert_array_equal(two["x"], x)  # make_array_from_process_local_data round trip
    np.testing.assert_allclose(two["y"], x.astype(np.float64) @ w, rtol=1e-4, atol=1e-4)
    # Each device computes the same block with the same local program either way: bitwise.
    np.testing.assert_array_equal(two["y"], single["y"])
    # The sum crosses processes through gloo, whose reduction order differs from XLA's
    # in-process one: equal to float32 rounding, not bitwise.
    np.testing.assert_allclose(two["total"], single["total"], rtol=1e-6)


def _wait_ready(procs, timeout=60):
    """Reads each process's output until it says ready; returns what each printed."""
    seen = [[] for _ in procs]
    deadline = time.monotonic() + timeout
    for i, p in enumerate(procs):
        while time.monotonic() < deadline:
            line = p.stdout.readline()
            if not line:
                raise AssertionError(f"process {i} ended early:\n" + "".join(seen[i]))
            seen[i].append(line)
            if "ready" in line:
                break
    return seen


def _slurm_job() -> dict[str, str]:
    """An srun-style environment for a job of 2 tasks on this host (each task adds its
    SLURM_PROCID and SLURM_LOCALID): JAX's SLURM detector derives the coordinator's port from
    the job id, so the job id is one whose port is free."""
    first = 65536 - 4096  # the detector's ports: first + job id % 4096
    for port in random.Random().sample(range(first, 65536), 64):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        break
    return {"SLURM_JOB_ID": str(port - first), "SLURM_STEP_NODELIST": "127.0.0.1",
            "SLURM_NTASKS": "2", "SLURM_STEP_NUM_NODES": "1"}


def _lose(victim: int, heartbeat_s: int = 10, how: int = signal.SIGKILL, slurm: bool = False):
    """Starts two processes (with the process flags, or as `srun` would start them), sends
    `victim` the signal `how` (SIGKILL: it dies; SIGSTOP: it hangs) once both run collectives;
    returns (survivor's exit status, seconds it took to exit, its output)."""
    common = ["--job=loop", "--cpu_devices=2", f"--heartbeat_timeout_s={heartbeat_s}"]
    if slurm:
        job = _slurm_job()
        procs = [_worker(*common, env=_env() | job | {"SLURM_PROCID": str(i),
                                                        "SLURM_LOCALID": str(i)})
                 for i in range(2)]
    else:
        port = local_cluster.free_port()
        common += [f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2"]
        procs = [_worker(*common, f"--process_id={i}") for i in range(2)]
    try:
        seen = _wait_ready(procs)
        procs[victim].send_signal(how)
        t0 = time.monotonic()
        survivor = procs[1 - victim]
        rest, _ = survivor.communicate(timeout=60)
        return survivor.returncode, time.monotonic() - t0, "".join(seen[1 - victim]) + rest
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def test_jax_still_keeps_the_private_coordination_state_hfjax_reads():
    """Lost-process detection reads JAX's private coordination state (no public API holds
    it): this fails as soon as a JAX release moves or renames what `jax_coordination` uses."""
    from jax._src import distributed as jax_distributed
    from jax._src.lib import _jax

    for attr in dist.COORDINATION_STATE_ATTRS:
        assert hasattr(jax_distributed.global_state, attr), attr
    for method in dist.COORDINATION_CLIENT_METHODS:
        assert callable(getattr(_jax.DistributedRuntimeClient, method, None)), method
    # One process, not joined: the state is there, empty.
    assert dist.jax_coordination() == (None, None)


def test_a_moved_coordination_state_is_a_clear_error(monkeypatch):
    from types import SimpleNamespace

    from jax._src import distributed as jax_distributed

    monkeypatch.setattr(jax_distributed, "global_state", SimpleNamespace(client=None))
    with pytest.raises(DistributedError, match=r"jax .* moved jax._src.distributed.global_state"
                                               r" .*coordinator_address.*install jax 0.10"):
        dist.jax_coordination()
    monkeypatch.setattr(jax_distributed, "global_state",
                        SimpleNamespace(client=object(), coordinator_address="h:1"))
    with pytest.raises(DistributedError, match="coordination client has no key_value_set, "
                                               "key_value_dir_get"):
        dist.jax_coordination()


# Killed (SIGKILL: an OOM kill too), or hung (SIGSTOP), started with the process flags or as
# srun starts them: every case is named the same way, within half of --heartbeat_timeout_s.
@pytest.mark.slow
@pytest.mark.parametrize("how, slurm", [(signal.SIGKILL, False), (signal.SIGSTOP, False),
                                        (signal.SIGKILL, True)], ids=["killed", "hung", "srun"])
def test_a_lost_process_is_named_and_the_other_exits(how, slurm):
    code, took, out = _lose(victim=1, how=how, slurm=slurm)
    assert code == dist.EXIT_LOST_PROCESS, out
    assert took < 5 + lost_process.lost_after_s(10) + 10, out
    last = out.strip().splitlines()[-1]
    assert last.startswith("hfjax: process 0 of 2 lost process 1: no heartbeat from it for 5 s "
                           "(half of --heartbeat_timeout_s=10)"), out
    # ... and the command that resumes: this process's own (no launcher named another).
    assert f"resume from the last checkpoint with: {sys.executable} -u {WORKER} --job=loop" in last


def test_a_peer_loss_seen_from_a_collective_is_not_a_user_error():
    """gloo reports a collective whose peer is gone as a ValueError: it waits for the watch to
    name the lost process instead of ending as a user error; other errors do not."""
    gone = ValueError("UNKNOWN: Gloo AllGather failed: [external/gloo/gloo/transport/tcp/"
                      "pair.cc:538] Read error [127.0.0.1]:19102: Connection reset by peer")
    assert lost_process.is_peer_loss(gone)
    assert lost_process.is_peer_loss(ValueError("Gloo AllGather failed: Connection closed by "
                                                "peer [127.0.0.1]:7601"))
    assert not lost_process.is_peer_loss(ValueError("data.train_batch_size=7 must divide 16"))
    assert not lost_process.is_peer_loss(KeyError(2))


@pytest.mark.slow
def test_a_lost_coordinator_ends_the_other_process():
    # Process 0 hosts jax.distributed's coordination service: when it goes, JAX ends the
    # others at once, and its message blames the leader task (process 0).
    code, took, out = _lose(victim=0)
    assert code != 0, out
    assert took < 60
    assert "leader task" in out or "lost the coordinator (process 0" in out, out


@pytest.mark.slow
def test_an_error_on_one_process_stops_the_others():
    code, out = _launch("--num_processes=2", "--devices_per_process=2", f"--script={WORKER}",
                        "--stop_grace_s=120", "--", "--job=loop", "--fail_on=1",
                        "--heartbeat_timeout_s=10")
    assert "[1] RuntimeError: a deliberate failure on this process" in out
    # Process 1 marks itself failed: process 0 names it at once, and does not call it lost
    # (a rerun would meet the same error).
    assert "[0] hfjax: process 0 of 2 stops: process 1 ended on an error (see its output)" in out
    assert code == dist.EXIT_ERROR, out


def test_launcher_stops_the_others_and_returns_the_failure(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        "import os, sys, time\n"
        "rank = int(os.environ['HFJAX_PROCESS_ID'])\n"
        "print('rank', rank, 'of', os.environ['HFJAX_NUM_PROCESSES'], flush=True)\n"
        "sys.exit(3) if rank == 1 else time.sleep(600)\n")
    t0 = time.monotonic()
    code, out = _launch("--num_processes=2", f"--script={script}", "--stop_grace_s=1",
                        timeout=60)
    assert code == 3, out
    assert time.monotonic() - t0 < 30
    assert "[0] rank 0 of 2" in out and "[1] rank 1 of 2" in out
    assert "process 0 killed by SIGTERM (143) (stopped here)" in out


def test_unreachable_coordinator_is_one_line_after_a_bounded_wait():
    port = local_cluster.free_port()
    t0 = time.monotonic()
    p = _worker(f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
                "--process_id=1", "--coordinator_timeout_s=3")
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 1
    assert time.monotonic() - t0 < 30
    last = out.strip().splitlines()[-1]
    assert last.startswith(f"hfjax: cannot reach the coordinator at 127.0.0.1:{port} within 3 s")


def test_bad_process_flags_fail_before_anything_starts():
    p = _worker("--coordinator_address=127.0.0.1:1", "--num_processes=2", "--process_id=2")
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 1
    assert out.strip().splitlines()[-1] == (
        "hfjax: --process_id=2 is out of range for --num_processes=2; process ids are 0..1, one "
        "per process")
    code, out = _launch("--num_processes=2", "--devices_per_process=2", f"--script={WORKER}",
                        "--", "--num_processes=3")
    assert code == 1
    assert out.count("disagrees with the launcher: launch.local_cluster started 2") == 2, out


def test_mesh_larger_than_all_processes_is_refused():
    code, out = _launch("--num_processes=2", "--devices_per_process=4", f"--script={WORKER}",
                        "--", "--job=mesh", "--mesh=fsdp=16")
    assert code == 1
    for rank in (0, 1):
        assert (f"[{rank}] hfjax: --mesh 'fsdp=16' needs 16 devices, the run has 8 cpu devices "
                "(2 processes x 4)") in out, out


def test_cpu_collectives_wait_long_unless_the_user_says_otherwise():
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    dist.safe_cpu_collectives(env)
    assert env["XLA_FLAGS"] == ("--xla_force_host_platform_device_count=8 "
                                "--xla_cpu_collective_call_terminate_timeout_seconds=600")
    mine = {"XLA_FLAGS": "--xla_cpu_collective_call_terminate_timeout_seconds=5"}
    dist.safe_cpu_collectives(mine)
    assert mine["XLA_FLAGS"] == "--xla_cpu_collective_call_terminate_timeout_seconds=5"
    # The test session itself runs with the longer wait (tests/conftest.py).
    assert "terminate_timeout_seconds=600" in os.environ["XLA_FLAGS"]


def test_cpu_thread_pool_has_room_for_blocked_collectives():
    """XLA:CPU runs every device's program on one thread pool, and a collective holds its thread
    until every device reaches it. With the default pool (one thread per device on a small
    machine), 8 devices blocked in two independent collectives took all 8 threads and a launch.train
    run hung for 600 s; the pool now has 4 threads per device unless the user sized it."""
    cores = os.cpu_count()
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    dist.safe_cpu_collectives(env)
    assert env["PJRT_NPROC"] == str(max(cores, 32))
    for given, devices, expect in [({}, 4, str(max(cores, 16))),  # launch.train --cpu_devices=4
                                   ({}, 1, None),  # one device: XLA's own size
                                   ({"PJRT_NPROC": "6"}, 8, "6")]:  # the user's choice
        dist.safe_cpu_collectives(given, devices=devices)
        assert given.get("PJRT_NPROC") == expect, (devices, given)
    # The variable reaches XLA: a fresh process with 8 devices has a pool of that many threads
    # (named tf_XLAEigen).
    if not os.path.isdir("/proc/self/task"):
        pytest.skip("counting a process's threads by name needs Linux's /proc")
    code = ("import glob, jax, jax.numpy as jnp; jax.jit(lambda a: a + 1)(jnp.ones(8))"
            ".block_until_ready(); print(sum(open(t + '/comm').read().strip() == 'tf_XLAEigen'"
            " for t in glob.glob('/proc/self/task/*')))")
    sub = {**os.environ, "JAX_PLATFORMS": "cpu", **env}
    out = subprocess.run([sys.executable, "-c", code], env=sub, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert int(out.split()[-1]) == max(cores, 32)


def test_simulated_device_count_is_kept_or_set_and_sizes_the_pool():
    cores = os.cpu_count()
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    assert dist.simulate_cpu_devices(8, environ=env) == 4  # a count the user gave wins
    assert env["PJRT_NPROC"] == str(max(cores, 16))
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    assert dist.simulate_cpu_devices(8, keep_given=False, environ=env) == 8
    assert env["XLA_FLAGS"].split()[:2] == ["--xla_force_host_platform_device_count=4",
                                            "--xla_force_host_platform_device_count=8"]
    assert env["PJRT_NPROC"] == str(max(cores, 32))

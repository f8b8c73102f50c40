"""Joining the processes of a run with `jax.distributed`, and leaving it cleanly when one is lost.

Every host runs the same entry point (multi-controller SPMD). Where a process learns who it is,
in order of precedence:

1. a launcher's environment: `launch.local_cluster` (or any launcher that sets them) exports
   HFJAX_COORDINATOR_ADDRESS, HFJAX_NUM_PROCESSES, HFJAX_PROCESS_ID and HFJAX_CPU_DEVICES;
2. a cluster that `jax.distributed.initialize()` detects by itself (Cloud TPU, SLURM, Open MPI,
   Kubernetes): JAX fills in the coordinator, the process count and this process's id;
3. the flags `--coordinator_address`, `--num_processes` and `--process_id`;
4. none of these: a single process, and `jax.distributed` is not started.

Flags that contradict the launcher or the cluster are refused rather than silently overridden.

Losing a process (a peer killed, out of memory or hung) is `hfjax.parallel.lost_process`'s:
every survivor names it and ends with `EXIT_LOST_PROCESS`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import socket
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
from absl import flags, logging

from hfjax.parallel import lost_process
from hfjax.parallel.cpu_devices import (  # noqa: F401  (imported from here by scripts and tests)
    CPU_COLLECTIVE_TIMEOUT_S,
    safe_cpu_collectives,
    simulate_cpu_devices,
)
from hfjax.parallel.lost_process import (  # noqa: F401  (the run's exit statuses, named here too)
    EXIT_ERROR,
    EXIT_LOST_PROCESS,
    before_error_exit,
)

ENV_COORDINATOR = "HFJAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "HFJAX_NUM_PROCESSES"
ENV_PROCESS_ID = "HFJAX_PROCESS_ID"
ENV_CPU_DEVICES = "HFJAX_CPU_DEVICES"
ENV_LAUNCHER = "HFJAX_LAUNCHER"
_LAUNCHER_KEYS = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)


class DistributedError(ValueError):
    """A run's process or device setup is wrong; the message says what and how to fix it."""


@dataclasses.dataclass(frozen=True)
class Settings:
    """What this process was told about the run, validated, before anything starts.

    `num_processes`, `process_id` and `coordinator_address` are None where a detected cluster
    supplies them through `jax.distributed.initialize()`. `source` says where they came from.
    """

    source: str
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    cpu_devices: int = 0  # 0: leave the CPU device count alone
    coordinator_timeout_s: int = 300
    heartbeat_timeout_s: int = 60
    shutdown_timeout_s: int = 300

    @property
    def distributed(self) -> bool:
        return self.source != "single process"


@dataclasses.dataclass(frozen=True)
class Topology:
    """The run this process belongs to, once joined."""

    process_id: int
    num_processes: int
    local_devices: int
    total_devices: int
    platform: str
    coordinator_address: str | None
    source: str

    def describe(self) -> str:
        """E.g. '8 cpu devices (2 processes x 4)' or '8 cpu devices (1 process)'."""
        if self.num_processes == 1:
            return f"{self.total_devices} {self.platform} devices (1 process)"
        per = self.total_devices / self.num_processes
        each = str(int(per)) if per == int(per) else f"{self.local_devices} here"
        return (f"{self.total_devices} {self.platform} devices "
                f"({self.num_processes} processes x {each})")


# --------------------------------------------------------------------------------------------
# Flags


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Defines the run's process flags on `flag_values`; a second call does nothing.

    Every entry point that can run on several hosts calls this at import time and
    `initialize_from_flags()` first thing in main.
    """
    if "coordinator_address" in flag_values:
        return
    fv = dict(flag_values=flag_values)
    flags.DEFINE_string(
        "coordinator_address", None,
        "host:port of process 0, which hosts jax.distributed's coordinator; with "
        "--num_processes and --process_id. Leave all three unset under launch.local_cluster, "
        "Cloud TPU, SLURM or Open MPI: they are detected.", **fv)
    flags.DEFINE_integer("num_processes", None, "processes in the run (one per host, usually)",
                         **fv)
    flags.DEFINE_integer("process_id", None, "this process's number, 0 .. num_processes-1", **fv)
    flags.DEFINE_integer(
        "cpu_devices", 1,
        "simulated CPU devices in this process when running on CPU, e.g. 8 to try placements "
        "and meshes on a laptop (0: leave the count alone)", **fv)
    flags.DEFINE_integer(
        "coordinator_timeout_s", 300,
        "seconds to wait for the coordinator to be reachable and for every process to join", **fv)
    flags.DEFINE_integer(
        "heartbeat_timeout_s", 60,
        "a process silent this long is declared lost, and the others stop (exit status "
        f"{EXIT_LOST_PROCESS})", **fv)
    flags.DEFINE_integer(
        "shutdown_timeout_s", 300,
        "at exit, seconds to wait for the other processes to finish too", **fv)


def _given(flag_values: flags.FlagValues, name: str):
    """The flag's value if it was given on the command line, else None."""
    flag = flag_values[name]
    return flag.value if flag.present else None


def settings_from_flags(
    flag_values: flags.FlagValues = flags.FLAGS,
    environ: Mapping[str, str] | None = None,
    cluster: tuple[str, int, int] | None = None,
    detect_cluster: bool = True,
) -> Settings:
    """Validates the process flags against the launcher's environment and a detected cluster.

    `cluster` is (name, process count, process id) of a cluster `jax.distributed` would
    detect; by default it is looked up. Raises DistributedError, naming the flag and the fix,
    before anything is started or compiled.
    """
    environ = os.environ if environ is None else environ
    if cluster is None and detect_cluster:
        cluster = detect_cluster_env()
    return resolve_settings(
        coordinator_address=_given(flag_values, "coordinator_address"),
        num_processes=_given(flag_values, "num_processes"),
        process_id=_given(flag_values, "process_id"),
        cpu_devices=_given(flag_values, "cpu_devices"),
        default_cpu_devices=flag_values["cpu_devices"].default,
        coordinator_timeout_s=flag_values.coordinator_timeout_s,
        heartbeat_timeout_s=flag_values.heartbeat_timeout_s,
        shutdown_timeout_s=flag_values.shutdown_timeout_s,
        environ=environ,
        cluster=cluster,
    )


def _env_int(environ: Mapping[str, str], key: str) -> int:
    try:
        return int(environ[key])
    except ValueError:
        raise DistributedError(f"environment {key}={environ[key]!r} is not an integer") from None


def resolve_settings(
    *,
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    cpu_devices: int | None = None,
    default_cpu_devices: int = 1,
    coordinator_timeout_s: int = 300,
    heartbeat_timeout_s: int = 60,
    shutdown_timeout_s: int = 300,
    environ: Mapping[str, str] | None = None,
    cluster: tuple[str, int, int] | None = None,
) -> Settings:
    """The pure core of `settings_from_flags`: flag values (None: not given) plus environment."""
    environ = {} if environ is None else environ
    for name, value in (("coordinator_timeout_s", coordinator_timeout_s),
                        ("heartbeat_timeout_s", heartbeat_timeout_s),
                        ("shutdown_timeout_s", shutdown_timeout_s)):
        if value <= 0:
            raise DistributedError(f"--{name}={value}; give a positive number of seconds")
    if cpu_devices is not None and cpu_devices < 0:
        raise DistributedError(f"--cpu_devices={cpu_devices}; give a count >= 1, or 0 to leave "
                               "the CPU device count alone")
    timeouts = dict(coordinator_timeout_s=coordinator_timeout_s,
                    heartbeat_timeout_s=heartbeat_timeout_s,
                    shutdown_timeout_s=shutdown_timeout_s)

    launcher_keys = [k for k in _LAUNCHER_KEYS if k in environ]
    env_devices = _env_int(environ, ENV_CPU_DEVICES) if ENV_CPU_DEVICES in environ else None
    if cpu_devices is not None and env_devices is not None and cpu_devices != env_devices:
        raise DistributedError(
            f"--cpu_devices={cpu_devices} disagrees with the launcher, which gave each process "
            f"{env_devices} ({ENV_CPU_DEVICES}); drop the flag, or change the launcher's "
            "--devices_per_process")
    if cpu_devices is None:
        if env_devices is not None:
            cpu_devices = env_devices
        elif "xla_force_host_platform_device_count" in environ.get("XLA_FLAGS", ""):
            cpu_devices = 0  # the user's XLA_FLAGS already says how many
        else:
            cpu_devices = default_cpu_devices

    if launcher_keys:
        missing = [k for k in _LAUNCHER_KEYS if k not in environ]
        if missing:
            raise DistributedError(
                f"the environment sets {', '.join(launcher_keys)} but not {', '.join(missing)}; "
                "a launcher must set all three (launch.local_cluster does)")
        launcher = environ.get(ENV_LAUNCHER, "the launcher")
        n, pid = _env_int(environ, ENV_NUM_PROCESSES), _env_int(environ, ENV_PROCESS_ID)
        _check_agrees("num_processes", num_processes, n, f"{launcher} started {n} processes")
        _check_agrees("process_id", process_id, pid, f"{launcher} made this process {pid}")
        address = environ[ENV_COORDINATOR]
        if coordinator_address is not None and coordinator_address != address:
            raise DistributedError(
                f"--coordinator_address={coordinator_address} disagrees with {launcher}, whose "
                f"coordinator is {address}; drop the flag")
        _check_range(n, pid, "")
        _split_address(address)
        return Settings(launcher, address, n, pid, cpu_devices, **timeouts)

    if cluster is not None:
        name, n, pid = cluster
        _check_agrees("num_processes", num_processes, n, f"{name} runs {n} processes")
        _check_agrees("process_id", process_id, pid, f"{name} made this process {pid}")
        if coordinator_address is not None:
            _split_address(coordinator_address)
        return Settings(name, coordinator_address, n, pid, cpu_devices, **timeouts)

    given = {"--coordinator_address": coordinator_address, "--num_processes": num_processes,
             "--process_id": process_id}
    if all(v is None for v in given.values()):
        return Settings("single process", cpu_devices=cpu_devices, **timeouts)
    missing = [k for k, v in given.items() if v is None]
    if missing:
        have = ", ".join(f"{k}={v}" for k, v in given.items() if v is not None)
        raise DistributedError(
            f"{have} also needs {' and '.join(missing)}: every process gets the coordinator's "
            "host:port (process 0's), the process count and its own number")
    _check_range(num_processes, process_id, "--")
    _split_address(coordinator_address)
    return Settings("flags", coordinator_address, num_processes, process_id, cpu_devices,
                    **timeouts)


def _check_agrees(name: str, given: int | None, actual: int, who: str) -> None:
    if given is not None and given != actual:
        raise DistributedError(f"--{name}={given} disagrees with the launcher: {who}; drop "
                               f"--{name} or make them agree")


def _check_range(n: int, pid: int, prefix: str) -> None:
    if n < 1:
        raise DistributedError(f"{prefix}num_processes={n}; a run has at least 1 process")
    if not 0 <= pid < n:
        raise DistributedError(
            f"{prefix}process_id={pid} is out of range for {prefix}num_processes={n}; process "
            f"ids are 0..{n - 1}, one per process")


def _split_address(address: str) -> tuple[str, int]:
    """('host', port) of 'host:port' or '[v6]:port'; DistributedError if malformed."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DistributedError(
            f"coordinator address {address!r} is not host:port (e.g. 10.0.0.1:1234, the "
            "address of process 0 and a free port)")
    return host.strip("[]"), int(port)


def detect_cluster_env() -> tuple[str, int, int] | None:
    """(name, process count, this process's id) of a cluster jax.distributed detects, or None.

    Asks the detectors `jax.distributed.initialize()` itself uses (SLURM, Open MPI, Cloud TPU,
    Kubernetes), so the answer is the one JAX will act on.
    """
    try:
        from jax._src import clusters
    except ImportError:  # a JAX without the detectors: only flags and launchers then
        return None
    for env in clusters.ClusterEnv._cluster_types:
        if env.opt_in_only_method:
            continue
        try:
            present = env.is_env_present()
        except Exception as err:  # a detector probing a service that is not there
            logging.warning("cluster detector %s failed: %s", env.__name__, err)
            continue
        if present:
            name = env.__name__.removesuffix("Cluster") or env.__name__
            return name, int(env.get_process_count()), int(env.get_process_id())
    return None


# --------------------------------------------------------------------------------------------
# Joining


_TOPOLOGY: Topology | None = None


def initialize_from_flags(flag_values: flags.FlagValues = flags.FLAGS) -> Topology:
    """Joins the run described by the process flags and the environment; see `initialize`."""
    return initialize(settings_from_flags(flag_values))


def initialize(settings: Settings) -> Topology:
    """Configures devices, joins the other processes and returns this process's Topology.

    Must run before anything touches a JAX backend. A second call returns the first result.
    On CPU the cross-process collectives are gloo's. Raises DistributedError with a one-line
    message for an unreachable coordinator, or processes that disagree on the process count;
    in a multi-process run, an error found after joining ends this process at once (the others
    then stop as for a lost process), since an orderly exit would wait for them forever.
    """
    global _TOPOLOGY
    if _TOPOLOGY is not None:
        return _TOPOLOGY
    safe_cpu_collectives(devices=settings.cpu_devices)
    import jax

    if settings.cpu_devices:
        jax.config.update("jax_num_cpu_devices", settings.cpu_devices)
    if not settings.distributed:
        _TOPOLOGY = _topology(settings, jax)
        return _TOPOLOGY

    if jax.config.jax_cpu_collectives_implementation != "mpi":
        # CPU devices of different processes share a collective only through a cross-process
        # implementation; gloo needs nothing but TCP. (Stated even where it is JAX's default,
        # which has changed between versions.)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if settings.coordinator_address is not None and settings.process_id not in (0, None):
        wait_for_coordinator(settings.coordinator_address, settings.coordinator_timeout_s)
    logging.info("joining %s as process %s of %s", settings.coordinator_address,
                 settings.process_id, settings.num_processes)
    jax.distributed.initialize(
        coordinator_address=settings.coordinator_address,
        num_processes=settings.num_processes,
        process_id=settings.process_id,
        initialization_timeout=settings.coordinator_timeout_s,
        heartbeat_timeout_seconds=settings.heartbeat_timeout_s,
        shutdown_timeout_seconds=settings.shutdown_timeout_s,
    )
    topology = _topology(settings, jax)
    if settings.num_processes is not None and topology.num_processes != settings.num_processes:
        lost_process.fail_now(
            f"hfjax: process {topology.process_id} was told --num_processes="
            f"{settings.num_processes}, but the coordinator (process 0) started the run with "
            f"{topology.num_processes}; give every process the same --num_processes")
    lost_process.install_exit_paths(settings.heartbeat_timeout_s)
    if topology.num_processes > 1:
        lost_process.start_watch(jax_coordination()[0], topology.process_id,
                                 topology.num_processes, topology.coordinator_address,
                                 settings.heartbeat_timeout_s)
    _TOPOLOGY = topology
    return topology


def _topology(settings: Settings, jax) -> Topology:
    address = settings.coordinator_address
    if address is None and settings.distributed:
        address = jax_coordination()[1]
    return Topology(
        process_id=jax.process_index(),
        num_processes=jax.process_count(),
        local_devices=jax.local_device_count(),
        total_devices=jax.device_count(),
        platform=jax.devices()[0].platform,
        coordinator_address=address,
        source=settings.source,
    )


# The JAX versions whose private coordination state `jax_coordination` was checked against.
COORDINATION_JAX_VERSIONS = ("0.10", "0.11")
# What of it hfjax uses: the state's attributes and the client's key-value methods.
COORDINATION_STATE_ATTRS = ("client", "coordinator_address")
COORDINATION_CLIENT_METHODS = ("key_value_set", "key_value_dir_get")


def jax_coordination() -> tuple[Any, str | None]:
    """(client, coordinator address) of the run `jax.distributed.initialize` joined.

    JAX has no public API for either: `jax.distributed` offers initialize, is_initialized and
    shutdown, and `multihost_utils.live_devices` is a collective that every process must enter,
    not a heartbeat a thread can keep. So this is the one place hfjax reads JAX's private
    `jax._src.distributed.global_state` (its key-value client feeds `LossWatch`);
    tests/parallel/test_distributed.py fails when a JAX release moves what it reads. Raises
    DistributedError naming the JAX version when the state is not where it was.
    """
    import jax

    version = ".".join(jax.__version__.split(".")[:2])
    if version not in COORDINATION_JAX_VERSIONS:
        logging.warning("jax %s: hfjax reads jax._src.distributed.global_state, checked "
                        "against jax %s only", jax.__version__,
                        ", ".join(COORDINATION_JAX_VERSIONS))
    try:
        from jax._src import distributed as jax_distributed

        state = jax_distributed.global_state
        client, address = (getattr(state, a) for a in COORDINATION_STATE_ATTRS)
    except (ImportError, AttributeError) as err:
        raise DistributedError(
            f"jax {jax.__version__} moved jax._src.distributed.global_state ({err}), which "
            "hfjax's lost-process detection reads; install jax "
            f"{' or '.join(COORDINATION_JAX_VERSIONS)}") from None
    missing = [m for m in COORDINATION_CLIENT_METHODS
               if client is not None and not hasattr(client, m)]
    if missing:
        raise DistributedError(
            f"jax {jax.__version__}: the coordination client has no {', '.join(missing)}, "
            "which hfjax's lost-process detection uses; install jax "
            f"{' or '.join(COORDINATION_JAX_VERSIONS)}")
    return client, address


def topology() -> Topology:
    """The Topology of the run joined by `initialize`; RuntimeError before it."""
    if _TOPOLOGY is None:
        raise RuntimeError("hfjax.parallel.distributed.initialize() has not run yet")
    return _TOPOLOGY


def wait_for_coordinator(address: str, timeout_s: float) -> None:
    """Returns once a TCP connection to `address` succeeds; DistributedError after timeout_s.

    JAX's own wait for an unreachable coordinator ends in a fatal abort with a stack trace;
    this probe turns the common case (process 0 not started, wrong host or port) into a
    one-line error first.
    """
    host, port = _split_address(address)
    deadline = time.monotonic() + timeout_s
    last: OSError | None = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise DistributedError(
                f"cannot reach the coordinator at {address} within {timeout_s:g} s "
                f"(--coordinator_timeout_s; last error: {last}): start process 0, which hosts "
                "it, or fix --coordinator_address")
        try:
            with socket.create_connection((host, port), timeout=min(2.0, left)):
                return
        except OSError as err:
            last = err
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


# --------------------------------------------------------------------------------------------
# Meshes against the devices of all processes


def check_mesh_fits(mesh: str, where: str = "mesh", topo: Topology | None = None) -> None:
    """DistributedError when the fixed axis sizes of `mesh` need more devices than the run has.

    Axes of size -1 fill whatever is left, so only the product of the fixed sizes counts.
    """
    from hfjax.parallel.mesh import MeshSpec

    topo = topo or topology()
    sizes = dict(MeshSpec.parse(mesh).sizes)
    need = math.prod(s for s in sizes.values() if s != -1)
    if need > topo.total_devices:
        raise DistributedError(
            f"{where} {mesh!r} needs {need} devices, the run has {topo.describe()}; add "
            "processes or devices per process (--cpu_devices on CPU), or shrink the mesh")


def check_config_meshes(cfg: Any, topo: Topology | None = None) -> None:
    """`check_mesh_fits` on every non-empty string field named `mesh` in a (nested) config."""

    def walk(node: Any, path: str):
        items = node.items() if hasattr(node, "items") else ()
        for key, value in items:
            here = f"{path}.{key}" if path else str(key)
            if key == "mesh" and isinstance(value, str) and value.strip():
                check_mesh_fits(value, f"config.{here}", topo)
            elif hasattr(value, "items"):
                walk(value, here)

    walk(cfg, "")


# --------------------------------------------------------------------------------------------
# Host-side decisions that every process must take alike


def is_main_process() -> bool:
    """True in process 0, the one that writes logs, plots and exported files (and in a
    single-process run)."""
    import jax

    return jax.process_index() == 0


def any_process(flag: bool) -> bool:
    """True on every process when `flag` is true on any of them (a collective: every process
    must call it at the same point). A stop request (SIGTERM) reaches the processes at slightly
    different moments; agreeing on it keeps them stopping after the same step, where one that
    ran a step more would wait in its collectives forever."""
    import jax

    if jax.process_count() == 1:
        return bool(flag)
    from jax.experimental import multihost_utils

    flags_all = multihost_utils.process_allgather(np.asarray([int(bool(flag))], np.int32))
    return bool(np.any(flags_all))


def check_same_on_every_process(items: Mapping[str, bytes | str]) -> None:
    """DistributedError naming each item whose value differs between processes.

    For host-side inputs that every process computes by itself and that must come out the
    same (the config, the data files each host reads, the data order): a host that read
    another copy of a parquet file would otherwise train on other rows without any error. Only
    digests travel (8 bytes an item). A collective: every process calls it with the same keys.
    """
    import jax

    if jax.process_count() == 1 or not items:
        return
    from jax.experimental import multihost_utils

    names = sorted(items)
    digests = np.stack([
        np.frombuffer(hashlib.sha256(_as_bytes(items[k])).digest()[:8], np.uint32)
        for k in names])
    every = np.asarray(multihost_utils.process_allgather(digests))  # [processes, items, 2]
    bad = [(k, [p for p in range(every.shape[0]) if not np.array_equal(every[p, i], every[0, i])])
           for i, k in enumerate(names)]
    bad = [(k, ps) for k, ps in bad if ps]
    if bad:
        raise DistributedError(
            "processes disagree on " + "; ".join(
                f"{k} (process{'es' if len(ps) > 1 else ''} {', '.join(map(str, ps))} "
                f"differ{'' if len(ps) > 1 else 's'} from process 0)" for k, ps in bad)
            + ": every process must run the same command on the same data files")


def _as_bytes(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()

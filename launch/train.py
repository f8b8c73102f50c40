"""Runs an RL job from an ml_collections config.

    python -m launch.train                                   # the default: PPO on arithmetic
    python -m launch.train --config=configs/grpo_arith.py
    python -m launch.train --config.placement=split --config.actor.mesh=fsdp=2,tensor=2

Prints a progress bar (a plain line every tenth of the run or 30 s when stdout is not a
terminal), per-stage timings and tokens/s; the last stdout line is JSON with the
held-out accuracy before and after RL with their 95% Wilson intervals over the held-out
prompts and the prompts' count, the throughput, the wall time, the step reached, the step
the run resumed from (null: a fresh start) and whether SIGTERM cut it short.

Across processes (`launch.local_cluster`, or every host of a cluster running this same command,
see docs/scaling.md), process 0 alone prints and writes metrics, TensorBoard and the plot;
checkpoints are written by all processes. Everything the run writes goes under
`--config.trainer.out_dir`: `metrics.jsonl` (one line per
step), `tensorboard/`, `metrics.png`, `tokenizer/` and `checkpoints/<step>/`. Rerunning the same
command continues from the newest readable checkpoint (`--config.trainer.resume=auto`, the
default; `disable` starts fresh; a path resumes from that checkpoint). On SIGTERM or Ctrl-C
(SIGINT) the run finishes its current step, saves a checkpoint and exits (status 0 after SIGTERM,
130 after Ctrl-C); a second signal ends it at once.

Every setting is checked before anything is built or written (`hfjax.config`); a bad one,
like any other mistake, ends the run with one line naming it (`launch.cli`; `--verbose` for
tracebacks).
"""

import json
import os
import signal
import sys
import time

from absl import flags, logging

from hfjax.config.validators import parse_sink_names
from hfjax.parallel import distributed, targets
from launch import cli

# --config, and the process flags (--cpu_devices, --coordinator_address, --num_processes,
# --process_id and the timeouts) shared by every entry point that can run on several hosts.
DEFAULT_CONFIG, _CONFIG = cli.define_run_flags("ppo_arith.py")
_DRY_RUN = flags.DEFINE_bool(
    "dry_run", False,
    "build every program of the configured run from abstract shapes, compile each ahead of "
    "time on --num_devices simulated CPU devices, print per-program memory and FLOPs against "
    "--target's memory, and exit: 0 when the run fits, 3 when it does not. Nothing is "
    "allocated and no weight is read.")
_TARGET = flags.DEFINE_string(
    "target", None,
    f"device the run is sized for: {', '.join(targets.TARGETS)}. With --dry_run, its memory "
    "is the limit; in a real run, it replaces the devices' own reported memory in the check "
    "before loading weights.")
_NUM_DEVICES = flags.DEFINE_integer(
    "num_devices", 8, "--dry_run: devices of the target the run gets (simulated CPU devices "
    "stand in for them)", lower_bound=1)
_DEVICE_MEMORY_GIB = flags.DEFINE_float(
    "device_memory_gib", None,
    "--dry_run and the check before loading weights: plan against this much memory per device "
    "(GiB) instead of --target's or the devices' own, e.g. to keep headroom for the runtime")
_MEMORY_CHECK = flags.DEFINE_bool(
    "memory_check", True,
    "before loading weights, run the dry run's check on the run's own devices and stop (exit "
    "status 3) when a program would not fit; needs a device memory size: --target, or the "
    "devices' own (GPU, TPU). CPU devices report none, so CPU runs skip it.")
# Exit status of a run (or a dry run) that does not fit in device memory.
EXIT_DOES_NOT_FIT = 3

_STAGES = ("gen_greedy", "reward_greedy", "reward_greedy_model", "gen", "filter",
           "old_log_prob", "ref", "values", "cost_values", "reward", "reward_model", "cost", "adv",
           "update_critic", "update_cost_critic", "update_actor")


class _Progress:
    """A metrics sink for the console: the progress (step, reward, tokens/s) and the run's
    throughput, counted over this process's RL steps after its first (which compiles).

    On a terminal the progress is a tqdm bar. Written to a file or a pipe (a cluster job's
    log) a bar's redraws would pile up as carriage returns, so there it is a plain line every
    `total / PLAIN_LINES` steps, every PLAIN_EVERY_S seconds when steps are slower, and at the
    last step."""

    PLAIN_LINES = 10
    PLAIN_EVERY_S = 30.0

    def __init__(self, total: int, desc: str, ckpt_dir: str, stream=None):
        self.total, self.desc, self.ckpt_dir = total, desc, ckpt_dir
        self.stream = stream or sys.stdout
        self.bar = None
        self.tokens = self.seconds = 0.0
        self.steps = 0
        self.last: dict = {}
        isatty = getattr(self.stream, "isatty", None)
        self.plain = not (isatty and isatty())
        self.every = max(1, -(-total // self.PLAIN_LINES))
        self.t0 = self.last_line = None

    def start(self, resumed_from):
        if resumed_from is not None:
            print(f"resuming from {os.path.join(self.ckpt_dir, str(resumed_from))}", flush=True)

    def write(self, step, m):
        if "perf/total_num_tokens" not in m:  # step 0: warm start and validation only
            return
        if self.steps:
            self.tokens += m["perf/total_num_tokens"]
            self.seconds += m["timing_s/step"]
        elif m.get("compile/programs"):  # the per-program list: metrics.jsonl, or --verbose
            self.print(f"step {step}: {m['compile/programs']:.0f} programs compiled in "
                       f"{m['timing_s/compile']:.1f} s (compile_s/* in metrics.jsonl)")
        self.steps += 1
        self.last = dict(m)
        if self.plain:
            self._plain_line(step, m)
            return
        if self.bar is None:  # opened at the first RL step, after the warm start's lines
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, initial=step - 1, desc=self.desc,
                            file=self.stream, dynamic_ncols=True)
        self.bar.set_postfix(reward=f"{m['critic/score/mean']:.2f}",
                             tok_s=f"{m['perf/throughput']:.0f}")
        self.bar.update(1)

    def _plain_line(self, step, m):
        now = time.perf_counter()
        if self.t0 is None:
            self.t0 = self.last_line = now - m.get("timing_s/step", 0.0)
        due = (step % self.every == 0 or step >= self.total
               or now - self.last_line >= self.PLAIN_EVERY_S)
        if not due:
            return
        self.last_line = now
        print(f"{self.desc}: step {step}/{self.total}, reward {m['critic/score/mean']:.2f}, "
              f"{m['perf/throughput']:.0f} tok/s, {now - self.t0:.0f}s elapsed",
              file=self.stream, flush=True)

    def print(self, line: str):
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _memory_limit(target) -> int | None:
    """Bytes per device to plan against: --device_memory_gib, else the target's."""
    if _DEVICE_MEMORY_GIB.value is not None:
        return int(_DEVICE_MEMORY_GIB.value * 2**30)
    return target.memory_bytes if target else None


def _target():
    # The name was checked with the other flags (hfjax.config.FLAG_KEYS["train"]).
    return targets.get_target(_TARGET.value) if _TARGET.value else None


def dry_run_main() -> int:
    """--dry_run: the table, the verdict and one JSON line; the exit status says whether the
    run fits."""
    target = _target()
    n = _NUM_DEVICES.value
    given = [f"--{k}" for k in ("coordinator_address", "num_processes", "process_id")
             if flags.FLAGS[k].present]
    if given:
        raise cli.UserError(f"--dry_run runs in one process; drop {', '.join(given)} (the "
                            f"devices of every process are simulated here: --num_devices={n})")
    import jax

    # Simulated CPU devices stand in for the target's, even on a machine with accelerators.
    jax.config.update("jax_platforms", "cpu")
    topo = distributed.initialize(distributed.Settings("single process", cpu_devices=n))
    distributed.check_config_meshes(_CONFIG.value, topo)
    from hfjax.models import backend
    from hfjax.run.dry_run import dry_run

    cfg = _CONFIG.value
    limit = _memory_limit(target)
    name = f"{target.name} ({target.description}, " if target else "devices ("
    where = (f"{n} x {name}{limit / 2**30:.1f} GiB each)" if limit
             else f"{n} devices (no --target: no memory limit)")
    print(f"hfjax dry run: {cfg.algorithm}, model {cfg.model.path or 'from scratch'}, "
          f"placement={cfg.placement}, on {where}; compiling on {n} simulated CPU devices",
          flush=True)
    platform = target.platform if target else None
    if platform and (differences := backend.stand_in_differences(platform)):
        print(f"  {differences}", flush=True)
    t0 = time.perf_counter()
    try:
        report = dry_run(
            cfg, device_memory_bytes=limit,
            target=target.name if target else None,
            platform=platform,
            on_program=lambda p: print(f"  compiled {p.name} in {p.compile_s:.1f}s", flush=True))
    except (ValueError, FileNotFoundError) as err:
        raise cli.UserError(f"cannot build the run: {err}") from None
    print(report.table())
    summary = report.summary()
    summary["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(summary), flush=True)
    if report.fits:
        return 0
    print(f"hfjax train: the run does not fit: {report.verdict()}; {report.advice()}",
          file=sys.stderr, flush=True)
    return EXIT_DOES_NOT_FIT


def _memory_check(cfg, say) -> None:
    """The dry run's check on the run's own devices, before any weight is loaded; exits with
    EXIT_DOES_NOT_FIT when a program would not fit."""
    import jax

    target = _target()
    limit = _memory_limit(target)
    if limit is None:
        stats = jax.local_devices()[0].memory_stats() or {}
        limit = stats.get("bytes_limit")
    if not _MEMORY_CHECK.value or limit is None:
        return
    from hfjax.run.dry_run import dry_run

    report = dry_run(cfg, device_memory_bytes=int(limit),
                     target=target.name if target else None)
    if cfg.model.remat_policy == "auto":  # the check decided it: the Trainer need not again
        cfg.model.remat_policy = report.remat_policy
        say(f"model.remat_policy=auto: {report.remat_policy} (dry run peak "
            f"{report.peak_bytes_per_device / 2**30:.2f} GiB per device of "
            f"{int(limit) / 2**30:.2f} GiB)", flush=True)
    if not report.fits:
        say(report.table())
        say(json.dumps(report.summary()), flush=True)
        print(f"hfjax train: the run does not fit in device memory: {report.verdict()}; "
              f"{report.advice()}; or pass --nomemory_check to try anyway", file=sys.stderr,
              flush=True)
        raise SystemExit(EXIT_DOES_NOT_FIT)
    logging.info("memory check: %s", report.verdict())


def main(argv):
    del argv
    cfg = _CONFIG.value
    t = cfg.trainer

    def dry_run():
        if _DRY_RUN.value:
            sys.exit(dry_run_main())

    topo = cli.start_run("train", cfg, before_jax=dry_run)

    from hfjax.run import intervals, metrics
    from hfjax.run.checkpoint import RunCheckpointer
    from hfjax.run.resume import check_resume, config_json
    from hfjax.run.trainer import Trainer

    t_start = time.perf_counter()
    stop = _StopRequest()
    signal.signal(signal.SIGTERM, stop.on_signal)
    signal.signal(signal.SIGINT, stop.on_signal)
    metrics.start_memory_tracking(t.jax_smi)
    ckpt_dir = os.path.join(t.out_dir, "checkpoints")
    # Every process runs this same controller; process 0 alone talks to the user and writes
    # metrics, TensorBoard and the plot (checkpoints are written by all, through Orbax).
    main_process = topo.process_id == 0
    say = print if main_process else (lambda *args, **kw: None)
    # A resume that contradicts the out_dir, names no checkpoint, continues another algorithm's
    # run or would append to a damaged metrics file is refused here, before anything is built.
    # (The directory is asked of all processes at once, before any of them creates it, so that
    # they all take the same answer.)
    exists = distributed.any_process(os.path.isdir(ckpt_dir))
    existing = RunCheckpointer(ckpt_dir, read_only=True) if exists else None
    if check_resume(cfg, existing, t.resume) and "jsonl" in parse_sink_names(t.logger):
        metrics.read_jsonl(os.path.join(t.out_dir, metrics.JSONL_NAME))
    _memory_check(cfg, say)
    trainer = Trainer(cfg)  # checks devices, data and rewards; builds, writes nothing
    say(f"hfjax: {cfg.algorithm} on {topo.describe()}, "
        f"placement={cfg.placement}, actor mesh={cfg.actor.mesh}, "
        f"compute={trainer.compute_dtype} (model.dtype={cfg.model.dtype}), out_dir={t.out_dir}",
        flush=True)
    ckpt = RunCheckpointer(ckpt_dir, max_to_keep=t.max_to_keep or None, async_save=t.async_save)
    progress = _Progress(t.total_steps, cfg.algorithm, ckpt_dir)
    if main_process:
        logger = metrics.make_logger(
            t.logger, t.out_dir, console=progress.print, console_every=t.log_every,
            wandb_project=t.project_name, wandb_name=t.experiment_name,
            config=config_json(cfg), extra=[progress],
        )
    else:
        logger = metrics.MetricsLogger()  # the records, kept in memory only
    try:
        result = trainer.fit(
            ckpt, logger, resume=t.resume,
            should_stop=lambda: distributed.any_process(stop.requested()),
            on_log=lambda i, m: say(f"  warm start step {i}: loss {m['sft/loss']:.3f}",
                                    flush=True),
        )
    finally:
        logger.close()
        ckpt.close()
        trainer.close()
    if not main_process:
        return
    history = logger.history
    if result.preempted:
        where = (f"checkpoint {os.path.join(ckpt_dir, str(result.step))}"
                 if os.path.isdir(os.path.join(ckpt_dir, str(result.step)))
                 else "no checkpoint (stopped in the warm start)")
        print(f"{stop.name}: stopped at step {result.step}, {where}; rerun the same command to "
              "resume", flush=True)
    last = progress.last
    if last:
        stages = "  ".join(f"{s} {last[f'timing_s/{s}']:.3f}s" for s in _STAGES
                           if f"timing_s/{s}" in last)
        print(f"last step timings: {stages}")
    accs = [(r["step"], a) for r in history if (a := metrics.val_accuracy(r)) is not None]
    before = next((a for s, a in accs if s == 0), None)
    after = accs[-1][1] if accs and accs[-1][0] > 0 else None
    if t.plot and history:
        png = metrics.plot_run(history, os.path.join(t.out_dir, metrics.PLOT_NAME),
                               title=f"{cfg.algorithm}: {t.out_dir}")
        if png:
            print(f"wrote {png}")
    n_test = len(trainer.test_data)

    def ci95(acc):  # Wilson over the held-out prompts (hfjax.run.intervals)
        return None if acc is None else [round(x, 4) for x in
                                         intervals.accuracy_interval(acc, n_test)]

    if after is not None:
        print(f"held-out accuracy after RL: {after:.3f} {intervals.fmt(*ci95(after))} (before "
              f"{_fmt(before)}{'' if before is None else ' ' + intervals.fmt(*ci95(before))}; "
              f"95% intervals over {n_test} prompts)")
    print(json.dumps({
        "heldout_accuracy_before": None if before is None else round(before, 4),
        "heldout_accuracy_after": None if after is None else round(after, 4),
        "heldout_accuracy_before_ci95": ci95(before),
        "heldout_accuracy_after_ci95": ci95(after),
        "heldout_prompts": n_test,
        "tokens_per_s": round(progress.tokens / progress.seconds, 1) if progress.seconds else 0.0,
        "wall_s": round(time.perf_counter() - t_start, 1),
        "step": result.step,
        "resumed_from": result.resumed_from,
        "preempted": result.preempted,
    }), flush=True)
    if stop.name == "SIGINT":
        sys.exit(cli.EXIT_INTERRUPTED)


class _StopRequest:
    """SIGTERM or SIGINT (Ctrl-C) sets the request; the trainer checks it between steps, saves
    and returns. The signals are then no longer caught, so a second one ends the process at
    once."""

    def __init__(self):
        self.name: str | None = None

    def on_signal(self, signum, frame):
        del frame
        self.name = signal.Signals(signum).name
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, signal.SIG_DFL)
        # os.write, not print: the handler may run while the main thread is inside a print.
        os.write(2, f"\n{self.name}: finishing the current step, then saving a checkpoint; "
                    "send it again to stop at once\n".encode())

    def requested(self) -> bool:
        return self.name is not None


def _fmt(x):
    return "n/a" if x is None else f"{x:.3f}"


if __name__ == "__main__":
    cli.run(main, "train", config_default=DEFAULT_CONFIG)

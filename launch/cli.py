"""What every entry point shares: flag parsing, one-line errors, Ctrl-C and `--verbose`.

    if __name__ == "__main__":
        cli.run(main, "generate", compilation_cache=True)

- A mistake the user can fix (a bad flag or setting, a missing or damaged file, a checkpoint
  that cannot be resumed) ends the program with one line on stderr,
  `hfjax <entry>: <what is wrong and how to fix it>`, and exit status 2 for flags that do not
  parse, 1 otherwise. No traceback.
- Any other exception is a bug: one line naming its type, and how to see the traceback.
- `--verbose` (or HFJAX_VERBOSE=1) shows tracebacks and every library log line.
- Ctrl-C ends the program with one line and status 130 (launch.train handles it itself: it
  finishes the step, saves and exits).
- With `compilation_cache=True` the entry point gets `--compilation_cache_dir` (see
  `launch.compile_cache`); launch.train takes it from its config instead.
- `HFJAX_SMOKE=1` shrinks the flags and config to a smoke run's sizes (`launch.smoke`).
- With `config_default`, `--config` (an ml_collections config file flag, defined by the entry
  point with default None) gets that file when not given, and a missing file or an unknown
  `--config.a.b` key is one line too.
"""

from __future__ import annotations

import difflib
import importlib.util
import logging as py_logging
import os
import re
import sys
from collections.abc import Callable

from absl import app, flags, logging

from launch import smoke

FLAGS = flags.FLAGS
_VERBOSE = flags.DEFINE_bool("verbose", False,
                             "show tracebacks and every log line (also HFJAX_VERBOSE=1)")
EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130


class UserError(Exception):
    """An error whose message alone tells the user what to do."""


def run(main: Callable[[list[str]], None], entry: str, *, compilation_cache: bool = False,
        config_default: str | None = None) -> None:
    """Runs `main` as the entry point named `entry` (see the module docstring). Never
    returns."""
    if compilation_cache:
        flags.DEFINE_string(
            "compilation_cache_dir", "auto",
            "JAX's persistent compilation cache: auto ($JAX_COMPILATION_CACHE_DIR, else "
            "~/.cache/hfjax/xla; off when HFJAX_COMPILATION_CACHE=off), off, or a directory")
    verbose = _verbose_requested(sys.argv)
    _quiet_logs(verbose)

    def parse(argv: list[str]) -> list[str]:
        try:
            if config_default is not None:
                argv = _with_config(argv, config_default)
            return FLAGS(argv)
        except Exception as err:  # noqa: BLE001  (every parse failure is the user's to fix)
            if verbose:
                raise
            _exit(f"hfjax {entry}: {one_line(_parse_message(err))}", EXIT_USAGE)

    def wrapped(argv: list[str]) -> None:
        logging.set_verbosity(logging.INFO if verbose else logging.WARNING)
        try:
            if len(argv) > 1:
                raise UserError(f"unexpected argument {argv[1]!r}: every setting is a flag, "
                                "--name=value (see --helpshort)")
            check_entry_flags(entry)
            # HFJAX_SMOKE=1: the least work that runs the same code path (launch.smoke).
            smoke.apply(entry, FLAGS)
            if compilation_cache:
                from launch import compile_cache

                compile_cache.enable(FLAGS.compilation_cache_dir, "--compilation_cache_dir")
            main(argv)
        except SystemExit:
            raise
        except (Exception, KeyboardInterrupt) as err:  # noqa: BLE001  (one line, see report)
            # Across processes, an error from a collective whose peer died waits for the loss
            # to be named (hfjax.parallel.distributed, loaded only by entry points that use it).
            dist = sys.modules.get("hfjax.parallel.distributed")
            if dist is not None:
                dist.before_error_exit(err)
            if verbose:
                raise
            _exit(*report(entry, err))

    app.run(wrapped, flags_parser=parse)


def check_entry_flags(entry: str, flag_values: flags.FlagValues = FLAGS) -> None:
    """Checks every flag of entry point `entry` against its row (`hfjax.config.flag_checks`)
    and the rules between them, as given on the command line, before anything runs."""
    from hfjax.config import check_flags, flag_checks

    check_flags(entry, {k: flag_values[k].value for k in flag_checks(entry) if k in flag_values})


def report(entry: str, err: BaseException) -> tuple[str, int]:
    """The one line and the exit status that entry point `entry` ends with for `err`."""
    if isinstance(err, KeyboardInterrupt):
        return f"hfjax {entry}: interrupted (Ctrl-C)", EXIT_INTERRUPTED
    if is_user_error(err):
        return f"hfjax {entry}: {one_line(str(err))}", EXIT_ERROR
    return (f"hfjax {entry}: internal error ({type(err).__name__}: {one_line(str(err))}); rerun "
            "with --verbose for the traceback and report it", EXIT_ERROR)


def is_user_error(err: BaseException) -> bool:
    """Whether `err`'s message is meant for the user (a setting, file or checkpoint to fix)."""
    if isinstance(err, (UserError, ValueError, OSError, app.UsageError, flags.Error)):
        return True
    # The library's errors for a damaged checkpoint and a refused non-finite update; looked up
    # only once loaded, so that this module never imports JAX.
    kinds = tuple(getattr(sys.modules.get(mod), name, None) for mod, name in (
        ("hfjax.run.checkpoint", "CheckpointCorrupt"), ("hfjax.run.health", "NonFiniteError")))
    kinds = tuple(k for k in kinds if k is not None)
    return bool(kinds) and isinstance(err, kinds)


def one_line(text: str) -> str:
    """`text` with every run of whitespace (newlines included) as one space."""
    return " ".join(str(text).split())


def _exit(line: str, code: int):
    sys.stdout.flush()
    print(line, file=sys.stderr, flush=True)
    # os._exit, not sys.exit: threads and atexit hooks of half-built state (an Orbax writer,
    # reward scorers) must not add their own output after the one line. Scorer processes
    # end with their parent.
    os._exit(code)


def _verbose_requested(argv: list[str]) -> bool:
    if os.environ.get("HFJAX_VERBOSE", "") not in ("", "0"):
        return True
    return any(re.fullmatch(r"--verbose(=(true|1|yes))?", a, re.I) for a in argv[1:])


class _DropLibraryNoise(py_logging.Filter):
    """Orbax's notes about its own options (e.g. read-only managers) say nothing a user can act
    on; they are shown with --verbose only."""

    def filter(self, record: py_logging.LogRecord) -> bool:
        return "/orbax/" not in record.pathname.replace(os.sep, "/")


def _quiet_logs(verbose: bool) -> None:
    if verbose:
        return
    # On the handler: a logger's own filters do not see records propagated from its children.
    logging.get_absl_handler().addFilter(_DropLibraryNoise())


# -- the --config flag ---------------------------------------------------------------------------

_CONFIG_ARG = re.compile(r"^--?config(=(.*))?$")


def _config_path(argv: list[str]) -> tuple[int, str | None]:
    for i, a in enumerate(argv[1:], 1):
        m = _CONFIG_ARG.match(a)
        if m:
            if m.group(1):
                return i, m.group(2)
            return i, argv[i + 1] if i + 1 < len(argv) else None
    return -1, None


def _with_config(argv: list[str], default: str) -> list[str]:
    """argv with `--config=<default>` first when no --config is given (ml_collections then reads
    the file when parsing the flags, where a failure is one line, rather than at import).

    The config file is loaded here first, so that a missing or failing file and an override of
    a key the config does not have are UserErrors that name them.
    """
    if any(a.startswith(("--flagfile", "-flagfile")) for a in argv[1:]):
        # A flagfile (launch.plan writes one) may hold --config and its overrides: read them
        # in place, so that the config is found there and defined once.
        argv = FLAGS.read_flags_from_files(argv, force_gnu=False)
        sys.argv[:] = argv
    index, path = _config_path(argv)
    if index < 0:
        argv = [argv[0], f"--config={default}", *argv[1:]]
        sys.argv[:] = argv  # ml_collections reads the overrides from sys.argv
        path = default
    cfg = _load_config(path or "", default)
    keys = set(_dotted(cfg))
    for a in argv[1:]:
        m = re.match(r"^--?(?:no)?config\.([^=]+)", a)
        if m and m.group(1) not in keys:
            close = difflib.get_close_matches(m.group(1), keys, n=1)
            hint = f"did you mean --config.{close[0]}?" if close else "see the config file"
            raise UserError(f"--config.{m.group(1)}: the config {path} has no such key; {hint}")
    return argv


def _load_config(path: str, default: str):
    file, _, arg = path.partition(":")
    if not file or not os.path.isfile(file):
        configs = os.path.dirname(default)
        known = sorted(f for f in os.listdir(configs) if f.endswith(".py") and f[0] != "_")
        raise UserError(f"--config={path}: no such config file; give a path such as "
                        f"{', '.join(os.path.join(os.path.relpath(configs), k) for k in known)}")
    try:
        spec = importlib.util.spec_from_file_location("hfjax_cli_config", file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.get_config(*([arg] if arg else []))
    except Exception as err:  # noqa: BLE001  (any failure of the user's config file)
        raise UserError(f"--config={path}: loading it raised {type(err).__name__}: {err}; fix "
                        "the config file") from None


def _parse_message(err: Exception) -> str:
    """One line for a flag that did not parse, naming the flag."""
    if isinstance(err, UserError):
        return str(err)
    text = one_line(str(err))
    if "before a value for --config was specified" in text:
        return f"{text}; put --config=FILE before the --config.* overrides"
    required = re.search(r"Flag --(\w+) must have a value other than None", text)
    if required:
        return f"--{required.group(1)} is required (see --helpshort)"
    if isinstance(err, flags.UnrecognizedFlagError):
        known = [f for f in FLAGS if not f.startswith(("config.", "help", "only_check"))]
        name = getattr(err, "flagname", "")
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"; did you mean --{close[0]}?" if close else "; see --helpshort"
        return f"unknown flag --{name}{hint}"
    return f"{text} (see --helpshort)"


def _dotted(cfg, prefix: str = ""):
    for k, v in cfg.items():
        yield prefix + k
        if hasattr(v, "items") and not isinstance(v, dict):
            yield from _dotted(v, prefix + k + ".")


def define_run_flags(default_config: str):
    """The flags of an entry point that runs from a config: `--config`, whose default is
    configs/`default_config` (returned as a path relative to the working directory, for
    `run(..., config_default=)`), and the process flags (`--cpu_devices`, `--coordinator_address`,
    `--num_processes`, `--process_id` and the timeouts) of every entry point that can run on
    several hosts. Returns (default config path, the `--config` flag holder)."""
    from ml_collections import config_flags

    from hfjax.parallel import distributed

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    default = os.path.normpath(os.path.join(os.path.relpath(root), "configs", default_config))
    # No default in the flag: `run` supplies it, so that the file is read when the flags are
    # parsed (where a bad file or override is one line) rather than when the module is imported.
    holder = config_flags.DEFINE_config_file(
        "config", None, f"configuration file (configs/*.py; default {default})")
    distributed.define_flags()
    return default, holder


def rounded(x: float | None, digits: int = 4) -> float | None:
    """`x` rounded for an entry point's JSON summary line (None stays None)."""
    return None if x is None else round(x, digits)


def start_run(entry: str, cfg, *, before_jax: Callable[[], None] | None = None):
    """The start every training entry point shares, in this order: its config checked
    (`hfjax.config`: one line for any bad setting, before JAX starts or anything is written;
    its flags were checked by `run`); `before_jax()` if given (launch.train's dry run exits
    there); the compilation cache (`trainer.compilation_cache_dir`); this process's devices
    and, on several hosts, the jax.distributed join; the config's meshes against the devices
    of all processes. Returns the topology (`hfjax.parallel.distributed.Topology`)."""
    from hfjax.config import check_config
    from hfjax.parallel import distributed
    from launch import compile_cache

    check_config(cfg)
    if before_jax is not None:
        before_jax()
    compile_cache.enable(cfg.trainer.compilation_cache_dir, "trainer.compilation_cache_dir")
    topo = distributed.initialize_from_flags()
    distributed.check_config_meshes(cfg, topo)
    import jax

    if jax.default_backend() == "cpu":
        # Simulated CPU devices share the cores and one thread pool (distributed.
        # safe_cpu_collectives): programs with collectives that overlap in flight can starve
        # each other's participants, so CPU runs dispatch synchronously.
        jax.config.update("jax_cpu_enable_async_dispatch", False)
    return topo

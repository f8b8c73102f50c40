"""Compares the three frameworks' results on one workload: asserts, table, ratios, JSON.

    python bench/peers/report.py tiny      # prints the table; the last line is JSON

Asserted before anything is printed: every framework ran the same number of steps, processed
the same prompt + response tokens in every step (rows x (prompt + new tokens)), generated
exactly `new_tokens` tokens for every sequence, and took exactly one optimizer update per step.

The roofline is the analytic FLOPs of one step (`workload.step_flops`) at the f32 matmul peak
that hfjax's process measured with a large `jnp.dot` in the same run.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workload  # noqa: E402

FRAMEWORKS = ("tunix", "trl", "hfjax")


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


def main() -> None:
    w = workload.get(sys.argv[1])
    results = load(w)
    if "hfjax" not in results:
        raise SystemExit(f"no hfjax result in {w.dir}; run bench/peers/run_hfjax.py first")
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
    head = f"{'framework':<8} {'tok/s':>8} {'step s':>7} {'gen s':>6} {'train s':>7} " \
           f"{'gen %':>5} {'roofline':>8}"
    print(head)
    print("-" * len(head))
    fracs = {}
    for fw in FRAMEWORKS:
        if fw not in results:
            print(f"{fw:<8} {'(not run)':>8}")
            continue
        r = results[fw]
        st = r["stages_median_s"]
        gen = st.get("gen")
        train = st.get("train", st.get("update_actor"))
        fracs[fw] = r["tok_s"] / roofline_tok_s
        gen_s = f"{gen:6.2f}" if gen is not None else f"{'-':>6}"
        train_s = f"{train:7.2f}" if train is not None else f"{'-':>7}"
        share = f"{100 * gen / r['median_step_s']:4.0f}%" if gen is not None else f"{'-':>5}"
        print(f"{fw:<8} {r['tok_s']:8.0f} {r['median_step_s']:7.2f} {gen_s} {train_s} {share} "
              f"{fracs[fw]:8.2f}")
    h = results["hfjax"]
    hst = h["stages_median_s"]
    print("hfjax stages (median s): " + ", ".join(f"{k} {v:.3f}" for k, v in hst.items()))

    def ratio(fw):
        return round(h["tok_s"] / results[fw]["tok_s"], 3) if fw in results else None

    summary = {
        "precision": w.precision,
        "hfjax_tok_s": round(h["tok_s"], 1),
        "tunix_tok_s": round(results["tunix"]["tok_s"], 1) if "tunix" in results else None,
        "trl_tok_s": round(results["trl"]["tok_s"], 1) if "trl" in results else None,
        "vs_tunix": ratio("tunix"),
        "vs_trl": ratio("trl"),
        "hfjax_roofline_frac": round(fracs["hfjax"], 3),
    }
    print(f"ratios: hfjax/tunix {summary['vs_tunix']}, hfjax/trl {summary['vs_trl']}")
    with open(os.path.join(w.dir, f"summary{w.suffix}.json"), "w") as f:
        json.dump({**summary, "workload": w.name, "precision": w.precision, "flops": flops,
                   "peak_flops": peak,
                   "roofline_frac": fracs}, f, indent=1)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

"""How a plan reads as text (what `launch/plan.py` prints): a duration in the unit that suits
it, the one-line description of a plan and its per-stage schedule table
(`hfjax.planner.search.Plan`).
"""

from __future__ import annotations

from hfjax.planner.search import Plan


def fmt_seconds(x: float) -> str:
    """'12.3 s', '45.6 ms' or '7.8 us'."""
    if x >= 1 or x == 0:
        return f"{x:.3g} s" if x < 100 else f"{x:.0f} s"
    if x >= 1e-3:
        return f"{x * 1e3:.3g} ms"
    return f"{x * 1e6:.3g} us"


def format_stage_table(p: Plan) -> list[str]:
    """Lines of a per-stage table: pool, start, end, duration and the largest parts."""
    lines = [f"  {'stage':<14}{'pool':<24}{'start':>10}{'end':>10}{'time':>10}  breakdown"]
    for s in p.schedule:
        parts = sorted(((k, v) for k, v in s.parts.items() if v > 0), key=lambda kv: -kv[1])
        text = ", ".join(f"{k} {fmt_seconds(v)}" for k, v in parts[:4])
        lines.append(f"  {s.name:<14}{s.pool:<24}{fmt_seconds(s.start):>10}"
                     f"{fmt_seconds(s.end):>10}{fmt_seconds(s.seconds):>10}  {text}")
    return lines


def describe(p: Plan) -> str:
    """One line: mode, pools with sizes and meshes, iteration time."""
    parts = []
    for name, sc in p.sets.items():
        meshes = ", ".join(f"{r} {c.layout.mesh}" + (f" (decode {c.decode_mesh})"
                                                      if c.decode_mesh else "")
                           for r, c in sc.choices.items())
        parts.append(f"{name}[{sc.size}]: {meshes}")
    return f"{p.mode:<10} {fmt_seconds(p.iteration_s):>9}   " + " | ".join(parts)

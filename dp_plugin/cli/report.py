"""``dp-plugin bench`` output: a markdown table and PNG plots (matplotlib).

Plots need the ``bench`` extra (``pip install 'dp_plugin[bench]'``); without
matplotlib the markdown is still written and the command says how to get
the plots.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from dp_plugin.cli.bandwidth import algbw, busbw
from dp_plugin.reduce.autotune import mib

GB = 1e9


def _series(result: dict[str, Any]) -> dict[tuple[str, int], list[dict[str, Any]]]:
    out: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in result["sweep"]:
        out.setdefault((row["engine"], row["size"]), []).append(row)
    return out


def markdown(result: dict[str, Any]) -> str:
    series = _series(result)
    refs = {r["bytes"]: r for r in result["references"]}
    head = "| size | " + " | ".join(f"{e} x{n} time / algbw / busbw" for e, n in series)
    lines = [head + " | loopback TCP | memcpy |",
             "|---:|" + "---:|" * (len(series) + 2)]
    for i, size in enumerate(result["sizes"]):
        cells = []
        for (_, n), rows in series.items():
            t = rows[i]["time_s"]
            cells.append(f"{t * 1e3:.3f} ms / {algbw(size, t) / GB:.3f} / "
                         f"{busbw(size, t, n) / GB:.3f}")
        ref = refs.get(size)
        extra = ([f"{algbw(size, ref[key]) / GB:.3f}" for key in ("loopback_tcp_s", "memcpy_s")]
                 if ref else ["-", "-"])
        lines.append(f"| {mib(size, '.4g')} | " + " | ".join(cells + extra) + " |")
    lines.append("\nBandwidths in GB/s (10^9 bytes/s); busbw = algbw x 2(n-1)/n.")
    lines += _check_cost(result)
    if result["models"]:
        lines += ["", "| model | engine | workers | gradients | buckets | fused (copies) "
                  "| fused (views) | fused (views, sum) | raw (same bytes, sum) "
                  "| busbw fused (views) / raw | busbw fused (views, sum) / raw | Horovod "
                  "grouped_allreduce | Horovod grouped / fused (views) "
                  "| per-tensor (unfused) | per-tensor / fused (views) |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for m in result["models"]:
            lines.append(_model_row(m))
    for name, why in result.get("skipped", {}).items():
        lines.append(f"\nNot run: {name} ({why}).")
    return "\n".join(lines) + "\n"


def _check_cost(result: dict[str, Any]) -> list[str]:
    """The shared-memory header check's cost (``--shm-check``), where measured."""
    rows = [r for r in result["sweep"] if "unchecked_s" in r]
    if not rows:
        return []
    lines = ["", "| size | engine | workers | checked (default) | unchecked | cost |",
             "|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {mib(r['bytes'], '.4g')} | {r['engine']} | {r['size']} | "
                     f"{r['time_s'] * 1e3:.3f} ms | {r['unchecked_s'] * 1e3:.3f} ms | "
                     f"{(r['time_s'] / r['unchecked_s'] - 1) * 100:+.1f}% |")
    return lines


def _model_row(m: dict[str, Any]) -> str:
    views = m.get("fused_views_s", m["fused_s"])
    summed = m.get("fused_views_sum_s")
    grouped = m.get("horovod_grouped_s")
    per = m.get("per_tensor_s")
    cells = [m["model"], m["engine"], str(m["size"]),
             f"{m['tensors']} ({mib(m['bytes'], '.4g')})",
             str(m["buckets"]), f"{m['fused_s'] * 1e3:.1f} ms", f"{views * 1e3:.1f} ms",
             f"{summed * 1e3:.1f} ms" if summed else "-", f"{m['raw_s'] * 1e3:.1f} ms",
             f"{m['raw_s'] / views:.2f}", f"{m['raw_s'] / summed:.2f}" if summed else "-",
             f"{grouped * 1e3:.1f} ms" if grouped else "-",
             f"{grouped / views:.2f}" if grouped else "-",
             f"{per * 1e3:.1f} ms" if per else "-", f"{per / views:.2f}" if per else "-"]
    return "| " + " | ".join(cells) + " |"


def draw_plots(result: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = _series(result)
    refs = result["references"]
    written = []
    for kind in ("busbw", "time"):
        fig, ax = plt.subplots(figsize=(6, 3.6), dpi=80)
        for (engine, n), rows in series.items():
            xs = [r["bytes"] for r in rows]
            ys = [busbw(r["bytes"], r["time_s"], n) / GB if kind == "busbw"
                  else r["time_s"] * 1e3 for r in rows]
            ax.plot(xs, ys, marker="o", markersize=3, label=f"{engine} x{n}")
        if kind == "busbw" and refs:
            xs = [r["bytes"] for r in refs]
            for key, label in (("loopback_tcp_s", "loopback TCP"), ("memcpy_s", "memcpy")):
                ax.plot(xs, [algbw(r["bytes"], r[key]) / GB for r in refs], linestyle="--",
                        label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("bytes per rank")
        ax.set_ylabel("bus bandwidth, GB/s" if kind == "busbw" else "all-reduce time, ms")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out / f"{kind}.png"
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


def write(result: dict[str, Any], out: Path, plots: bool = True) -> list[Path]:
    """results.md and, when matplotlib imports, busbw.png and time.png."""
    md = out / "results.md"
    md.write_text(markdown(result))
    written = [md]
    if plots:
        try:
            written += draw_plots(result, out)
        except ImportError:
            print("dp-plugin bench: matplotlib is not installed, no plots; "
                  "pip install 'dp_plugin[bench]'", file=sys.stderr)
    return written

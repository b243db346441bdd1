"""Bar chart of a benchmark run: samples/s on a log axis, one group per workload."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any


def draw(rows: list[dict[str, Any]], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.get("samples_per_s")]
    if not rows:  # only sections without rates ran (start-up times): the tables say it all
        return
    workloads: list[str] = []
    for r in rows:
        if r["workload"] not in workloads:
            workloads.append(r["workload"])
    fig, axes = plt.subplots(
        len(workloads),
        1,
        figsize=(11, 1.1 + 0.42 * len(rows) + 0.5 * len(workloads)),
        squeeze=False,
        gridspec_kw={
            "height_ratios": [sum(r["workload"] == w for r in rows) + 1 for w in workloads]
        },
    )
    for ax, workload in zip(axes[:, 0], workloads, strict=True):
        mine = [r for r in rows if r["workload"] == workload]
        names = [textwrap.shorten(r["pipeline"], 70) for r in mine]
        values = [r["samples_per_s"] for r in mine]
        colors = [
            "tab:orange"
            if any(w in r["pipeline"] for w in ("dlop", "ShardReader", "open_archive"))
            else "tab:gray"
            for r in mine
        ]
        bars = ax.barh(range(len(mine)), values, color=colors)
        ax.set_xscale("log")
        ax.set_yticks(range(len(mine)), names, fontsize=8)
        ax.invert_yaxis()
        ax.set_title(textwrap.shorten(workload, 110), fontsize=9, loc="left")
        for bar, v in zip(bars, values, strict=True):
            ax.text(
                bar.get_width(),
                bar.get_y() + bar.get_height() / 2,
                f" {v:,.0f}",
                va="center",
                fontsize=7,
            )
        ax.set_xlim(min(values) / 2, max(values) * 8)
    axes[-1, 0].set_xlabel("samples/s (log scale); orange: dlop")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.4 / fig.get_figheight()))  # room for the title
    fig.savefig(out, dpi=100)
    plt.close(fig)

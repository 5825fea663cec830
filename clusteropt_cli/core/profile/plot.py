"""`--plot FILE.png`: throughput against latency across an endpoint sweep (matplotlib, headless)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from clusteropt_cli.core.profile.report import ProfileReport
from clusteropt_cli.deps import require


def plot_endpoint(report: ProfileReport, path: Path) -> None:
    """Two panels: TTFT p50/p90 and TPOT p50 (ms) against output tok/s, one point per level, labelled."""
    matplotlib = require("matplotlib", "profile")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = [lv for lv in report.levels if lv.completed > 0]
    fig, (ax_ttft, ax_tpot) = plt.subplots(1, 2, figsize=(10, 4))
    x = [lv.output_tokens_per_s for lv in levels]
    labels = [f"c={lv.concurrency}" if lv.concurrency is not None else f"{lv.rate}/s" for lv in levels]
    for ax, key, title in ((ax_ttft, "ttft_s", "TTFT"), (ax_tpot, "tpot_s", "TPOT")):
        for pct, style in (("p50", "o-"), ("p90", "s--")):
            y = [getattr(lv, key).get(pct, float("nan")) * 1e3 for lv in levels]
            ax.plot(x, y, style, label=f"{title} {pct}")
        for xi, lv, label in zip(x, levels, labels, strict=True):
            ax.annotate(label, (xi, getattr(lv, key).get("p50", float("nan")) * 1e3),
                        textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(f"{title} (ms)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    if not levels:
        ax_ttft.text(0.5, 0.5, "no request completed", ha="center", transform=ax_ttft.transAxes)
    fig.suptitle(f"{report.model.get('name', '')} @ {report.workload.get('url', '')}", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".png", dir=path.parent)
    os.close(fd)
    try:
        fig.savefig(tmp, format="png", dpi=110)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    finally:
        plt.close(fig)

"""Step-time plots of two runs side by side (``opml trace compare --png``).

Uses matplotlib's object API with the Agg canvas (no pyplot, no display, no global state), so it
works on headless machines and from threads.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from opml_trace_collector.analysis import percentile


def plot_step_times(series: Sequence[tuple[str, Sequence[float]]], out: Path) -> Path:
    """Write a PNG with one panel per (label, step times in seconds), sharing the y axis.

    Each panel shows every step's time in milliseconds, the median as a dashed line and the
    p95 as a dotted one, so a change (a batch size, an input pipeline) shows as a shifted band.
    """
    if not series:
        raise ValueError("plot_step_times needs at least one series")
    figure = Figure(figsize=(6 * len(series), 4), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, len(series), sharey=True, squeeze=False)[0]
    for ax, (label, times) in zip(axes, series):
        millis = [t * 1000 for t in times]
        ax.plot(range(len(millis)), millis, linewidth=0.8, marker=".", markersize=2, label="step")
        if millis:
            ax.axhline(percentile(millis, 0.5), color="tab:orange", linestyle="--",
                       label=f"median {percentile(millis, 0.5):.1f} ms")
            ax.axhline(percentile(millis, 0.95), color="tab:red", linestyle=":",
                       label=f"p95 {percentile(millis, 0.95):.1f} ms")
        ax.set_title(f"{label} ({len(millis)} steps)", fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper right")
    axes[0].set_ylabel("step time (ms)")
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, format="png")
    return out

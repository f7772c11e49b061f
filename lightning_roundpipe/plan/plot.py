"""Timeline pictures: a Gantt chart of a simulated schedule (needs matplotlib)."""

from __future__ import annotations

from pathlib import Path

from .simulate import SimulationResult

__all__ = ["plot_timeline"]

_COLOURS = {"F": "#4C72B0", "R": "#DD8452", "B": "#55A868"}
_NAMES = {"F": "forward", "R": "recompute", "B": "backward"}


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ImportError(
            "plot_timeline needs matplotlib, which is not installed; install the plot extra: "
            "pip install 'lightning_roundpipe[plot]'"
        ) from None
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def plot_timeline(
    result: SimulationResult,
    path: str | Path,
    *,
    title: str | None = None,
    width: float | None = None,
    dpi: int = 120,
    time_unit: str = "estimated cost units",
) -> Path:
    """Write a PNG Gantt chart of ``result``: devices as rows; forward,
    recompute and backward in distinct colours; micro-batch numbers on the
    bars; the bubble ratio in the title. ``time_unit`` names the unit of the
    time axis: ``"seconds"`` for measured times, the default for size-based
    estimates. Returns the path written."""
    plt = _pyplot()
    from matplotlib.patches import Patch

    n = result.num_devices
    span = result.makespan or 1.0
    fig_w = width if width is not None else min(24.0, max(8.0, 0.12 * len(result.timeline) / n + 6))
    fig, ax = plt.subplots(figsize=(fig_w, 0.6 * n + 1.6))
    try:
        for seg in result.timeline:
            y = n - 1 - seg.device
            ax.broken_barh(
                [(seg.start, seg.duration)],
                (y + 0.1, 0.8),
                facecolors=_COLOURS[seg.kind],
                edgecolors="white",
                linewidth=0.6,
            )
            if seg.duration / span > 0.012:
                label = str(seg.microbatch)
                if result.iterations > 1:
                    label = f"{seg.iteration}:{label}"
                ax.text(
                    seg.start + seg.duration / 2,
                    y + 0.5,
                    label,
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white",
                )
        ax.set_yticks([n - 1 - d + 0.5 for d in range(n)])
        ax.set_yticklabels([f"device {d}" for d in range(n)])
        ax.set_ylim(0, n)
        ax.set_xlim(0, span)
        ax.set_xlabel(f"time ({time_unit})")
        ratio = f"bubble {result.bubble_ratio:.1%}"
        if result.async_bubble_ratio is not None:
            ratio += f", steady-state with async optimizer {result.async_bubble_ratio:.1%}"
        head = title or f"{result.schedule}: {n} devices, {result.num_microbatches} micro-batches"
        ax.set_title(f"{head} ({ratio})", fontsize=10)
        kinds = sorted({s.kind for s in result.timeline}, key="FRB".index)
        ax.legend(
            handles=[Patch(color=_COLOURS[k], label=_NAMES[k]) for k in kinds],
            loc="upper center",
            bbox_to_anchor=(0.5, -0.22),
            ncol=3,
            fontsize=8,
            frameon=False,
        )
        fig.tight_layout()
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=dpi)
    finally:
        plt.close(fig)
    return out

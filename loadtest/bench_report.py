"""What every benchmark ends with: the JSON and its plot written, and the targets' verdicts printed;
and the timing the micro-benchmarks share."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path


def median_seconds(call: Callable[[], object], repeats: int) -> float:
    """The median of `repeats` timed calls, after one untimed."""
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def write_and_report(results: dict, path: Path, plot: Callable[[dict, Path], Path | None]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, default=float))
    plot_path = plot(results, path.with_suffix(".png"))
    print("\nkey figures:")
    for key, verdict in results["targets"].items():
        print(f"  {key} = {verdict['value']:.3f} (target {verdict['target']}: {'met' if verdict['met'] else 'MISSED'})")
    print(f"wrote {path}" + (f" and {plot_path}" if plot_path else " (no matplotlib: no plot)"))


def pyplot():
    """matplotlib's pyplot drawing into files, or None where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def paired_bars(path: Path, labels: list[str], pairs: dict[str, list[float]], ylabel: str, title: str) -> Path | None:
    """Two bars for each label, one per series of `pairs` (its name, its values in the labels' order), into
    path; None where matplotlib is not installed."""
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.5))
    xs = range(len(labels))
    for offset, (name, values) in zip((-0.2, 0.2), pairs.items(), strict=True):
        ax.bar([x + offset for x in xs], values, 0.4, label=name)
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def print_and_write(results: dict, path: Path | None, plot: Callable[[dict, Path], None]) -> None:
    """The results printed; with a path, written there as JSON and plotted beside it."""
    print(json.dumps(results, indent=2))
    if path:
        path.write_text(json.dumps(results, indent=2) + "\n")
        plot(results, path.with_suffix(".png"))

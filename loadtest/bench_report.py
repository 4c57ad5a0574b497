"""What every benchmark ends with: the JSON and its plot written, and the targets' verdicts printed."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path


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


def print_and_write(results: dict, path: Path | None, plot: Callable[[dict, Path], None]) -> None:
    """The results printed; with a path, written there as JSON and plotted beside it."""
    print(json.dumps(results, indent=2))
    if path:
        path.write_text(json.dumps(results, indent=2) + "\n")
        plot(results, path.with_suffix(".png"))

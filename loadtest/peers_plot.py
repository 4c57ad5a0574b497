"""The peer benchmark's figure: one bar panel per workload, each engine's median over the rounds."""

from __future__ import annotations

from pathlib import Path

TITLES = {
    "decode_tok_s": "decode tok/s (higher is better)",
    "ttft_s": "time to first token, s (lower is better)",
    "useful_tok_s": "useful tok/s (higher is better)",
}
OURS, PEER = "#4472c4", "#a5a5a5"


def plot_results(results: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    panels = [(name, r) for name, r in results["workloads"].items() if r.get("median")]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 4.6), squeeze=False)
    for ax, (name, r) in zip(axes[0], panels):
        bars = r["median"]
        colors = [OURS if engine.startswith("drivetrain") else PEER for engine in bars]
        ax.bar(list(bars), list(bars.values()), color=colors)
        ax.set_title(f"{name}: {r['streams']} stream(s)\n{TITLES[r['metric']]}", fontsize=9)
        ax.tick_params(axis="x", labelsize=7, labelrotation=35)
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right")
    meta = results["meta"]
    fig.suptitle(
        f"SmolLM2-135M on {meta['threads']} CPU threads, greedy, {meta['rounds']} round(s)"
        f"{' (quick)' if meta['quick'] else ''}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

"""The disaggregation benchmark's figure: decode ITL and long-prompt TTFT per layout (median bars,
each round a dot), the KV moved per handoff against the prompt's block size, and one round's
inter-token gaps over time with the long prompts' arrivals marked."""

from __future__ import annotations

from pathlib import Path

LAYOUT_COLORS = {"unified": "#7f7f7f", "disaggregated": "#4472c4"}


def plot_results(results: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    layouts = [name for name in LAYOUT_COLORS if name in results["median"]]
    fig, (itl, ttft, kv, timeline) = plt.subplots(1, 4, figsize=(19, 4.4))
    _bars(itl, results, layouts, ["decode_itl_quiet_p50_ms", "decode_itl_quiet_p99_ms", "decode_itl_p50_ms", "decode_itl_p99_ms"],
          ["p50 before", "p99 before", "p50 during", "p99 during"], "decode inter-token gap, ms",
          "decode streams, before and while long prompts arrive")  # fmt: skip
    _bars(ttft, results, layouts, ["long_ttft_p50_ms", "long_ttft_p99_ms"], ["p50", "p99"], "ms", "long prompts' TTFT")
    _kv(kv, results)
    _timeline(timeline, results, layouts)
    s = results["settings"]
    fig.suptitle(
        f"{results['model']}: {s['streams']} streams x {s['max_tokens']} tokens, {s['long_prompts']} prompts of "
        f"{s['long_tokens']} tokens every {s['long_interval_s']:g} s; {results['cores']} shared cores, "
        f"{s['rounds']} round(s) per layout"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _bars(ax, results: dict, layouts: list[str], keys: list[str], labels: list[str], ylabel: str, title: str) -> None:
    width = 0.8 / len(layouts)
    for j, layout in enumerate(layouts):
        xs = [i + (j - (len(layouts) - 1) / 2) * width for i in range(len(keys))]
        ax.bar(xs, [results["median"][layout][k] for k in keys], width, color=LAYOUT_COLORS[layout], label=layout)
        for x, key in zip(xs, keys):
            dots = [r[key] for r in results["headlines_per_round"][layout]]
            ax.plot([x] * len(dots), dots, "k.", markersize=4)
    ax.set_xticks(range(len(keys)), labels)
    ax.set(ylabel=ylabel, title=title)
    ax.legend(fontsize="small")


def _kv(ax, results: dict) -> None:
    check = results.get("kv_check") or {}
    if not check:
        ax.set_axis_off()
        return
    values = [check["expected_bytes_per_request"] / 2**20, check["measured_bytes_per_request"] / 2**20]
    ax.bar(["expected\n(prompt blocks)", "measured\n(counter / handoffs)"], values, color=["#a5a5a5", "#4472c4"])
    for i, v in enumerate(values):
        ax.text(i, v, f"{v:.1f}", ha="center", va="bottom")
    seconds = results["median"]["disaggregated"]["handoff_seconds_mean"]
    ax.set(ylabel="MiB per long-prompt handoff", title=f"KV moved per handoff; {seconds * 1000:.0f} ms each (mean)")


def _timeline(ax, results: dict, layouts: list[str]) -> None:
    for layout in reversed(layouts):  # unified's points on top: its stalls are the few high ones
        trace = results["timelines"].get(layout)
        if not trace:
            continue
        marker = "x" if layout == "unified" else "."
        ax.plot(trace["t_s"], trace["gap_ms"], marker, markersize=3, color=LAYOUT_COLORS[layout], label=layout, alpha=0.7)
        for sent in trace["long_sent_s"]:
            ax.axvline(sent, color=LAYOUT_COLORS[layout], linewidth=0.6, linestyle="--")
    ax.set(xlabel="s since the first long prompt (dashed: each one sent)", ylabel="gap, ms",
           title="decode gaps in the last round")  # fmt: skip
    ax.set_yscale("log")
    ax.legend(fontsize="small", markerscale=4)

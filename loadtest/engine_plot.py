"""The engine benchmark's figure: one bar panel per scenario, from its JSON results."""

from __future__ import annotations

from pathlib import Path


def plot_results(results: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    panels = []
    if "skewed" in results:
        r = results["skewed"]
        bars = {"continuous": r["continuous_tok_s"], "static": r["static_tok_s"], "static\n(release)": r["static_release_tok_s"]}
        bars.update({f"HF {k[:-6]}": v for k, v in r.get("hf", {}).items() if k.endswith("_tok_s")})
        panels.append(("skewed lengths: useful output tok/s", bars))
    if "long_prompt" in results:
        r = results["long_prompt"]
        ways = {"chunked": "chunked", "chunked_by_tokens": "chunked\n(by tokens)", "unchunked": "unchunked"}
        panels.append(("long prompt: decode ITL p99 (ms)", {label: r[k]["itl_p99_ms"] for k, label in ways.items() if k in r}))
    if "memory" in results:
        r = results["memory"]
        panels.append(("requests running at once", {"paged": r["paged_concurrent_median"], "reserved": r["reserved_concurrent"]}))
    if "prefix" in results:
        r = results["prefix"]
        panels.append(("shared prefix: requests/s", {k: r[k]["requests_per_s"] for k in ("cached", "uncached")}))
    if "decode" in results:
        r = results["decode"]
        bars = {"bound\n1": r["bound_tok_s"]}
        bars.update({k[6:].replace("_", "\n"): v for k, v in r.items() if k.startswith("tok_s_")})
        panels.append(("decode output tok/s", bars))
    if "controls" in results:
        r = results["controls"]
        panels.append(("decode step of 64 (ms)", {"plain": r["step_s_plain"] * 1e3, "penalties\n+ logprobs": r["step_s_controlled"] * 1e3}))
    if "structured" in results:
        r = results["structured"]
        panels.append(("decode step of 64 (ms)", {"plain": r["step_s_plain"] * 1e3, "JSON schema": r["step_s_json_schema"] * 1e3}))
    if "overhead" in results:
        r = results["overhead"]
        bars = {f"{k[11:]}\nrunning": v for k, v in r.items() if k.startswith("step_ms_at_")}
        panels.append((f"engine's own step, stub {r['stub_shape']} (ms)", bars))
    if "overlap" in results:
        r = results["overlap"]
        bars = {}
        for key in (k for k in r if k.startswith("batch_")):
            label = key[6:].replace("_", "\n", 1).replace("_", " ")  # "256\n16 penalised"
            bars[f"{label} in\nturn"] = r[key]["step_ms_off"]
            bars[f"{label} over-\nlapped"] = r[key]["step_ms_on"]
        panels.append((f"step on a simulated {r['device_ms']} ms device (ms)", bars))
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False)
    for ax, (title, bars) in zip(axes[0], panels):
        ax.bar(list(bars), list(bars.values()), color="#4472c4")
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", labelsize=8)
    meta = results["meta"]
    fig.suptitle(f"engine: {meta['model']} on {meta['gpu'] or meta['device']}{' (quick)' if meta['quick'] else ''}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

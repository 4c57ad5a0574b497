"""The fleet simulator's figure: per profile, goodput and ITL p99 against offered load (unified vs
disaggregated) and region TTFT p99 over the day (overflow off vs on). Every title says SIMULATED."""

from __future__ import annotations

from pathlib import Path


def plot_results(results: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig = figure(results)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def figure(results: dict):
    import matplotlib.pyplot as plt

    profiles = {n: p for n, p in results["profiles"].items() if "scenario_a" in p}
    fig, axes = plt.subplots(len(profiles), 3, figsize=(17, 4.6 * len(profiles)), squeeze=False)
    for row, (name, profile) in zip(axes, profiles.items()):
        goodput_panel(row[0], name, profile["scenario_a"])
        itl_panel(row[1], name, profile["scenario_a"])
        regions_panel(row[2], name, profile["scenario_b"])
    fig.suptitle("SIMULATED serving fleet (loadtest/sim_fleet.py): a model of the engine, not a measurement", fontsize=13)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    return fig


def goodput_panel(ax, name: str, a: dict) -> None:
    rates = a["rates_req_s"]
    for slo, style in (("tight", "-"), ("loose", "--")):
        for system, colour in (("unified", "tab:blue"), (a["best_split"][slo]["split"], "tab:orange")):
            runs = a["runs"][system]
            ax.plot(rates[:len(runs)], [r["slo"][slo]["goodput_req_s"] for r in runs], style, color=colour, marker=".",
                    label=f"{system}, {slo} SLO")
    ax.plot(rates, rates, ":", color="grey", label="offered")
    ax.set_xlabel("offered load (req/s)")
    ax.set_ylabel("goodput (req/s within SLO)")
    ax.set_title(f"SIMULATED {name}: goodput, {a['num_gpus']} GPUs", fontsize=10)
    ax.legend(fontsize=7)


def itl_panel(ax, name: str, a: dict) -> None:
    rates = a["rates_req_s"]
    split = a["best_split"]["tight"]["split"]
    for system, colour in (("unified", "tab:blue"), (split, "tab:orange")):
        runs = a["runs"][system]
        ax.plot(rates[:len(runs)], [r["itl_s"]["p99"] * 1e3 for r in runs], color=colour, marker=".", label=system)
    tight = next(s for s in a["slos"] if s["name"] == "tight")
    ax.axhline(tight["itl_s"] * 1e3, color="grey", ls=":", label="tight ITL bound")
    ax.set_yscale("log")
    ax.set_xlabel("offered load (req/s)")
    ax.set_ylabel("ITL p99 over all tokens (ms)")
    ax.set_title(f"SIMULATED {name}: ITL p99, unified vs {split}", fontsize=10)
    ax.legend(fontsize=7)


def regions_panel(ax, name: str, b: dict) -> None:
    colours = ("tab:blue", "tab:orange", "tab:green", "tab:red")
    for mode, style in (("off", "--"), ("on", "-")):
        for region in b["runs"][mode]["regions"]:
            hours = range(len(region["ttft_p99_s_by_hour"]))
            ax.plot(hours, region["ttft_p99_s_by_hour"], style, color=colours[region["region"] % len(colours)],
                    label=f"region {region['region']}, overflow {mode}")
    ax.axhline(b["ttft_slo_s"], color="grey", ls=":", label="TTFT bound")
    ax.set_yscale("log")
    ax.set_xlabel(f"hour of the (compressed) day: 24 h = {b['day_s']:.0f} simulated s")
    ax.set_ylabel("TTFT p99 (s), RTT included")
    share = b["runs"]["on"]["cross_region_share"]
    ax.set_title(f"SIMULATED {name}: TTFT p99, {b['num_regions']} regions x {b['gpus_per_region']} GPUs\n"
                 f"peak {b['peak_over_capacity']:g}x a region's capacity; overflow on serves {share:.0%} elsewhere", fontsize=10)
    ax.legend(fontsize=6, ncol=2)

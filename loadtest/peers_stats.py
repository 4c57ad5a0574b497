"""Interleaved rounds and paired ratios: on a shared machine the neighbours' load drifts, so each
round runs every engine once (in a rotating order) and a ratio is taken within a round, where
both sides saw the same neighbours, before the median across rounds."""

from __future__ import annotations

import statistics


def round_order(names: list[str], round_index: int) -> list[str]:
    """Round r starts with the r-th engine: over len(names) rounds each engine runs once in each slot."""
    if not names:
        return []
    shift = round_index % len(names)
    return names[shift:] + names[:shift]


def paired_ratio(ours: list[float], theirs: list[float]) -> float:
    """Median over rounds of ours[r] / theirs[r]."""
    if len(ours) != len(theirs) or not ours:
        raise ValueError(f"rounds differ or are empty: {len(ours)} vs {len(theirs)}")
    return statistics.median(a / b for a, b in zip(ours, theirs))


def summarise(per_round: dict[str, list[float]], ours: list[str]) -> dict:
    """Each engine's median, and every (ours, peer) paired ratio, keyed 'ours/peer'."""
    medians = {name: statistics.median(values) for name, values in per_round.items()}
    ratios = {
        f"{mine}/{peer}": paired_ratio(per_round[mine], per_round[peer])
        for mine in ours if mine in per_round
        for peer in per_round if peer not in ours
    }
    return {"median": medians, "ratio": ratios}

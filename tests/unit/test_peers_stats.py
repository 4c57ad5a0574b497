"""The peer benchmark's round math: rotating order, ratios paired within a round, then the median."""

from __future__ import annotations

import pytest

from loadtest.peers_stats import paired_ratio, round_order, summarise


def test_each_engine_runs_once_in_each_slot_over_as_many_rounds():
    names = ["a", "b", "c"]
    orders = [round_order(names, r) for r in range(3)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert round_order(names, 4) == orders[1]
    assert round_order([], 2) == []


def test_ratio_is_paired_within_rounds_not_a_ratio_of_medians():
    # The neighbours slow round 1 for both sides: paired ratios stay 2.0; medians' ratio would not.
    ours, theirs = [20.0, 2.0, 19.0], [10.0, 1.0, 12.0]
    assert paired_ratio(ours, theirs) == pytest.approx(2.0)
    assert 19.0 / 10.0 != pytest.approx(2.0)


def test_rounds_must_pair_up():
    with pytest.raises(ValueError):
        paired_ratio([1.0, 2.0], [1.0])
    with pytest.raises(ValueError):
        paired_ratio([], [])


def test_summarise_pairs_each_of_ours_with_each_peer_only():
    per_round = {"drivetrain:float32": [2.0, 4.0], "drivetrain:bfloat16": [4.0, 8.0], "llama_f32": [1.0, 2.0],
                 "hf_generate": [4.0, 4.0]}
    summary = summarise(per_round, ["drivetrain:float32", "drivetrain:bfloat16"])
    assert summary["median"]["drivetrain:float32"] == 3.0
    assert summary["ratio"] == {
        "drivetrain:float32/llama_f32": 2.0, "drivetrain:float32/hf_generate": 0.75,
        "drivetrain:bfloat16/llama_f32": 4.0, "drivetrain:bfloat16/hf_generate": 1.5,
    }

"""The overload benchmark's CI-sized run: it runs end to end, writes its figures, and sheds free first."""

from __future__ import annotations

import json

from loadtest import bench_overload


def test_quick_run_writes_its_figures_and_refuses_free_before_enterprise(tmp_path):
    out = tmp_path / "overload.json"
    results = bench_overload.main(["--quick", "--json", str(out)])
    assert json.loads(out.read_text())["refused"] == results["refused"]
    assert out.with_suffix(".png").stat().st_size > 0
    refused = results["refused_fraction"]
    assert refused["free"] > refused["enterprise"] and refused["free"] > 0.2
    assert results["capacity_req_s"] > 0 and results["enterprise_ttft_p99_unloaded_s"] > 0

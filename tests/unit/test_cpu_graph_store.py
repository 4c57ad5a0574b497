"""The store of compiled CPU decode graphs: which sizes a library takes, which folders it keeps, and
which it refuses to load (before AOTInductor maps a file cut short, or a weight is taken that is not
what the library was built with)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from services.worker.engine import cpu_graph_store
from services.worker.engine.cpu_graph_store import OWN_WEIGHTS, RECORD, DecodeLibrary, Shapes, StoreDamaged
from services.worker.engine.shared_weights import SharedWeights, form_of


def test_a_library_covers_the_sizes_within_its_ranges_alone() -> None:
    one_row = Shapes(rows=(1, 1), positions=(2, None))
    assert one_row.covers(1, 32) and one_row.covers(1, 1 << 20)
    assert not one_row.covers(2, 32) and not one_row.covers(1, 1)
    int8_rows = Shapes(rows=(2, 127), positions=(2, None))
    assert int8_rows.covers(127, 64) and not int8_rows.covers(128, 64) and not int8_rows.covers(1, 64)


def test_the_store_keeps_the_most_recently_used_folders_within_its_bytes_and_builds_in_progress(
        tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(cpu_graph_store, "STORE_BYTES", 10_000)
    for age, (name, size) in enumerate([("a", 3000), ("b", 3000), ("c", 3000), ("d", 3000), ("e", 10)]):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "graph.so").write_bytes(b"x" * size)
        os.utime(folder, (1_000_000 - age, 1_000_000 - age))  # a: used last
    (tmp_path / ".building-now").mkdir()  # another process's build in progress
    abandoned = tmp_path / ".building-long-ago"
    abandoned.mkdir()
    os.utime(abandoned, (1_000_000, 1_000_000))
    cpu_graph_store._prune(tmp_path, keep={tmp_path / "e"})  # e: this process's, though used first
    assert sorted(p.name for p in tmp_path.iterdir()) == [".building-now", "a", "b", "c", "e"]


def test_many_small_libraries_stay_where_their_bytes_fit(tmp_path) -> None:
    for name in range(12):  # four variants of three libraries each, as a benchmark of variants builds
        (tmp_path / str(name)).mkdir()
        (tmp_path / str(name) / "graph.so").write_bytes(b"x" * 1000)
    cpu_graph_store._prune(tmp_path, keep=set())
    assert len(list(tmp_path.iterdir())) == 12


def recorded_folder(tmp_path, files: dict[str, bytes], weights: dict[str, dict] | None = None):
    folder = tmp_path / "library"
    folder.mkdir()
    for name, data in files.items():
        (folder / name).write_bytes(data)
    record = {"shapes": {"rows": [1, 1], "positions": [2, None]}, "files": {n: len(d) for n, d in files.items()},
              "weights": weights or {}}
    (folder / RECORD).write_text(json.dumps(record))
    return folder


@pytest.mark.parametrize("damage", ["cut short", "missing", "record unreadable", "record of another form",
                                    "a weight of another form", "a weight the model lacks", "a weight kept nowhere",
                                    "a weight in two places"])
def test_a_damaged_library_is_refused_before_anything_is_loaded(tmp_path, damage: str) -> None:
    norm = torch.ones(8)
    weight = {"key": f"{form_of(norm)} 00", "model": "norm.weight"}
    folder = recorded_folder(tmp_path, {OWN_WEIGHTS: b"w" * 4096, cpu_graph_store.SHARED_OBJECT: b"not ELF"},
                             {"constant0": weight})
    record = json.loads((folder / RECORD).read_text())
    if damage == "cut short":
        os.truncate(folder / OWN_WEIGHTS, 1000)
    elif damage == "missing":
        (folder / OWN_WEIGHTS).unlink()
    elif damage == "record unreadable":
        (folder / RECORD).write_text('{"shapes": ')
    elif damage == "record of another form":
        (folder / RECORD).write_text('{"shapes": [1, 2], "files": 5}')
    elif damage == "a weight of another form":
        norm = torch.ones(4)
    elif damage == "a weight the model lacks":
        weight["model"] = "lm_head.packed"
    elif damage == "a weight kept nowhere":
        weight = {"key": weight["key"], "file": "../../elsewhere.pt"}
    else:
        weight = {**weight, "file": OWN_WEIGHTS}
    if damage.startswith("a weight"):
        (folder / RECORD).write_text(json.dumps({**record, "weights": {"constant0": weight}}))
    with pytest.raises(StoreDamaged):
        DecodeLibrary(folder, SharedWeights([("norm.weight", norm)]))

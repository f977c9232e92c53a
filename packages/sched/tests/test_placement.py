"""Placements: built from stage indices, read back from JSON, printed as runs of layers."""

import json

import pytest

from megatrain_sched import DEVICE, HOST, RECOMPUTE, Placement, PlacementError, StagePlacement


def test_build_where_and_runs():
    placement = Placement.build(8, resident=(0, 1), held=(2, 3), offloaded=(1, 2), kept=(5, 6), host_kept=(4,))
    assert placement.resident == (0, 1) and placement.held == (2, 3) and placement.offloaded == (1, 2)
    assert placement.kept == (5, 6) and placement.host_kept == (4,)
    assert placement.where(weights="streamed", products=RECOMPUTE) == (7,)
    runs = [(first, last) for first, last, _ in placement.runs()]
    # the embedding and the head are runs of their own even where their choices equal the blocks'
    assert runs == [(0, 0), (1, 1), (2, 2), (3, 3), (4, 4), (5, 6), (7, 7)]
    assert [(first, last) for first, last, _ in Placement.build(5).runs()] == [(0, 0), (1, 3), (4, 4)]


def test_json_round_trip_keeps_every_choice():
    placement = Placement.build(
        6,
        resident=(0,),
        held=(1,),
        offloaded=(1, 2),
        kept=(4,),
        host_kept=(3,),
        parked=(0,),
        tokens=16384,
        gradient_pool=7.0,
    )
    again = Placement.from_dict(json.loads(json.dumps(placement.as_dict())))
    assert again == placement and again.tokens == 16384 and again.gradient_pool == 7.0 and again.parked == (0,)
    with pytest.raises(PlacementError, match="not a placement"):
        Placement.from_dict({"stages": []})


def test_unknown_choices_are_refused():
    with pytest.raises(PlacementError, match="products must be one of recompute, device, host; got 'kept'"):
        StagePlacement(products="kept")
    assert StagePlacement(checkpoint=HOST, products=DEVICE).checkpoint == HOST


def test_table_names_layer_ranges():
    placement = Placement.build(6, held=(1, 2), kept=(3, 4))
    names = ["embedding", "layer 0", "layer 1", "layer 2", "layer 3", "head"]
    lines = placement.table(names).splitlines()
    assert lines[0].split() == ["stages", "weights", "checkpoint", "matmul", "products"]
    assert lines[2].split() == ["layer", "0", "..", "layer", "1", "(2)", "held", "on", "device", "recomputed"]
    assert lines[3].split() == [
        "layer",
        "2",
        "..",
        "layer",
        "3",
        "(2)",
        "streamed",
        "on",
        "device",
        "kept",
        "on",
        "device",
    ]
    assert lines[1].split()[-2:] == ["-", "-"] and lines[-1].split()[-2:] == ["-", "-"]

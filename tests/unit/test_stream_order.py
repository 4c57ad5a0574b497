"""Edges put routed events back in seq order, exactly once."""

from services.edge.stream_order import StreamOrder
from shared import wire


def tok(seq):
    return wire.Token("r", seq, f"t{seq}")


def done(seq):
    return wire.Done("r", seq, "stop", wire.Usage(1, 0, seq))


def test_in_order_passes_through():
    order = StreamOrder()
    assert order.push(tok(0)) == [tok(0)]
    assert order.push(tok(1)) == [tok(1)]


def test_duplicates_are_dropped():
    order = StreamOrder()
    order.push(tok(0))
    order.push(tok(1))
    assert order.push(tok(0)) == [] and order.push(tok(1)) == []
    assert order.num_duplicates == 2


def test_early_events_wait_for_the_gap():
    order = StreamOrder()
    assert order.push(tok(1)) == []
    assert order.push(tok(2)) == []
    assert order.push(tok(1)) == []  # duplicate of a waiting one
    assert order.push(tok(0)) == [tok(0), tok(1), tok(2)]


def test_terminal_event_finishes_and_later_ones_are_ignored():
    order = StreamOrder()
    assert order.push(done(1)) == []
    assert order.push(tok(0)) == [tok(0), done(1)]
    assert order.finished
    assert order.push(tok(2)) == []


def test_out_of_band_error_ends_the_stream_at_once():
    order = StreamOrder()
    order.push(tok(0))
    order.push(tok(2))  # waiting for 1
    lost = wire.Error("r", wire.OUT_OF_BAND, "worker_lost", "gone", True)
    assert order.push(lost) == [lost]
    assert order.finished and order.push(tok(1)) == []

"""A step's events for one edge: one message per shard, a request always in the same shard and in
order, and each message carrying the epochs of its own resumed requests only."""

from services.worker.token_shards import shard_of, token_batches
from shared import wire


def test_requests_keep_their_shard_and_their_order():
    ids = [f"r{i}" for i in range(40)]
    events = [wire.Token(rid, seq, f"{rid}:{seq}") for seq in range(3) for rid in ids]
    batches = token_batches("edge-0", "w1", events, {}, num_shards=4, sent_at=12.5)
    keys = [key for key, _ in batches]
    assert len(batches) == 4 and sorted(keys) == [b"edge-0#0", b"edge-0#1", b"edge-0#2", b"edge-0#3"]
    for key, batch in batches:
        shard = int(key.rpartition(b"#")[2])
        assert all(shard_of(e.request_id, 4) == shard for e in batch.events)
        assert (batch.edge_id, batch.worker_id, batch.sent_at) == ("edge-0", "w1", 12.5)
        for rid in {e.request_id for e in batch.events}:
            assert [e.seq for e in batch.events if e.request_id == rid] == [0, 1, 2]
    assert sorted(e.text for _, b in batches for e in b.events) == sorted(e.text for e in events)
    assert token_batches("edge-0", "w1", events, {}, 4, 0.0)[0][0] == keys[0]  # the same every time


def test_each_message_carries_only_its_own_requests_epochs():
    a, b = "ra", next(f"r{i}" for i in range(100) if shard_of(f"r{i}", 2) != shard_of("ra", 2))
    events = [wire.Token(a, 0, "x"), wire.Token(b, 0, "y")]
    batches = dict(token_batches("e", "w", events, {a: 3, b: 5, "elsewhere": 9}, num_shards=2, sent_at=0.0))
    assert {batch.events[0].request_id: batch.epochs for batch in batches.values()} == {a: {a: 3}, b: {b: 5}}
    (only,) = token_batches("e", "w", events, {}, num_shards=1, sent_at=0.0)
    assert only[0] == b"e#0" and only[1].epochs == {} and only[1].events == events


def test_no_events_no_messages():
    assert token_batches("e", "w", [], {"r": 1}, num_shards=4, sent_at=0.0) == []

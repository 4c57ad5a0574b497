"""The router -> edge handshake and frame MACs as plain functions: both ends prove the fleet
secret, and nothing can be injected into, reordered in or replayed onto a session."""

import pytest

from shared.link_auth import LinkKeys, LinkRefused

KEYS = LinkKeys(b"fleet secret")


def handshake(edge_keys=KEYS, router_keys=KEYS, edge_id="edge-0", expected="edge-0"):
    hello = edge_keys.hello(edge_id)
    proof = router_keys.prove(hello, "router-0")
    accept = edge_keys.check_proof(hello, proof)
    router_keys.check_accept(hello, proof, accept, expected)
    return edge_keys.session(hello, proof), router_keys.session(hello, proof)


def test_both_ends_agree_on_a_session_and_frames_pass():
    edge, router = handshake()
    for body in (b"one", b"", b"three" * 1000):
        assert edge.open(router.seal(body)) == body


def test_a_router_without_the_secret_is_refused_by_the_edge():
    with pytest.raises(LinkRefused, match="router's proof"):
        handshake(router_keys=LinkKeys(b"guess"))


def test_an_edge_without_the_secret_or_not_the_one_meant_is_refused_by_the_router():
    with pytest.raises(LinkRefused, match="router's proof|edge's proof"):
        handshake(edge_keys=LinkKeys(b"guess"))
    with pytest.raises(LinkRefused, match="expected edge edge-0"):
        handshake(edge_id="edge-1")


def test_injected_reordered_replayed_or_tampered_frames_are_refused():
    edge, router = handshake()
    first, second = router.seal(b"first"), router.seal(b"second")
    with pytest.raises(LinkRefused):
        edge.open(second)  # out of order
    assert edge.open(first) == b"first"
    with pytest.raises(LinkRefused):
        edge.open(first)  # replayed
    with pytest.raises(LinkRefused):
        edge.open(second[:-1] + b"X")  # tampered
    with pytest.raises(LinkRefused):
        edge.open(b"short")
    assert edge.open(second) == b"second"
    other_edge, _ = handshake()
    with pytest.raises(LinkRefused):
        other_edge.open(router.seal(b"for another session"))

"""API keys at the handshake, and config precedence: flags > environment > profile > defaults."""

import argparse

import pytest

from services.edge.auth import authenticate, parse_api_keys
from services.edge.config import EdgeConfig
from services.router.config import RouterConfig
from shared.config import add_config_arguments, config_from_namespace


def test_keys_from_header_or_query():
    keys = parse_api_keys("dev-key:dev, ops-key:ops")
    assert authenticate(keys, {"authorization": "Bearer dev-key"}, {}) == "dev"
    assert authenticate(keys, {}, {"api_key": "ops-key"}) == "ops"
    assert authenticate(keys, {"authorization": "Bearer nope"}, {}) is None
    assert authenticate(keys, {"authorization": "Basic dev-key"}, {}) is None
    assert authenticate(keys, {}, {}) is None


def test_malformed_key_spec_is_a_config_error():
    with pytest.raises(ValueError, match="key:tenant"):
        parse_api_keys("dev-key")


def load(cls, argv, monkeypatch, env=None):
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, cls)
    return config_from_namespace(cls, parser.parse_args(argv))


def test_precedence(monkeypatch):
    assert load(EdgeConfig, [], monkeypatch).port == 8080
    assert load(EdgeConfig, [], monkeypatch, {"DRIVETRAIN_PORT": "9000"}).port == 9000
    assert load(EdgeConfig, ["--port", "9001"], monkeypatch, {"DRIVETRAIN_PORT": "9000"}).port == 9001


def test_compose_profile(monkeypatch):
    config = load(EdgeConfig, ["--profile", "compose"], monkeypatch)
    assert config.kafka_bootstrap == "kafka:9092" and config.host == "0.0.0.0"
    with pytest.raises(ValueError, match="unknown profile"):
        load(EdgeConfig, ["--profile", "moon"], monkeypatch)


def test_config_is_frozen(monkeypatch):
    config = load(EdgeConfig, [], monkeypatch)
    with pytest.raises(AttributeError):
        config.port = 1


def test_router_edge_peers(monkeypatch):
    config = load(RouterConfig, ["--edges", "edge-0=127.0.0.1:9180,edge-1=127.0.0.1:9181"], monkeypatch)
    assert config.edge_addresses() == {"edge-0": ("127.0.0.1", 9180), "edge-1": ("127.0.0.1", 9181)}
    with pytest.raises(ValueError):
        load(RouterConfig, ["--edges", "edge-0"], monkeypatch).edge_addresses()

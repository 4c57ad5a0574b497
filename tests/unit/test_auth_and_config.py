"""API keys at the handshake, and settings: flags > environment > profile > defaults, nested
sections, one variable per setting, clear errors, and a reference that is the code's own."""

import pytest

from services.edge.auth import Credential, authenticate, parse_api_keys
from services.edge.settings import EdgeSettings
from services.edge.tenants import book_from_keys, hash_key
from services.router.settings import RouterSettings
from services.settings_reference import DOC, rewritten
from services.worker.settings import WorkerSettings
from shared.infra.settings import InfraSettings
from shared.membership.settings import LAN
from shared.service_settings import ServiceSettings
from shared.settings import SettingsError, load, setting_docs


def test_keys_from_header_or_query():
    keys = book_from_keys(parse_api_keys("dev-key:dev, ops-key:ops"), {}, "standard").tenant_of
    assert authenticate(keys, {"authorization": "Bearer dev-key"}, {}) == Credential("dev", hash_key("dev-key"))
    assert authenticate(keys, {}, {"api_key": "ops-key"}).tenant == "ops"
    assert authenticate(keys, {"authorization": "Bearer nope"}, {}) is None
    assert authenticate(keys, {"authorization": "Basic dev-key"}, {}) is None
    assert authenticate(keys, {}, {}) is None


def test_malformed_key_spec_is_a_config_error():
    with pytest.raises(ValueError, match="key:tenant"):
        parse_api_keys("dev-key")


def test_precedence(monkeypatch):
    assert load(EdgeSettings, []).port == 8080
    monkeypatch.setenv("DRIVETRAIN_PORT", "9000")
    assert load(EdgeSettings, []).port == 9000
    assert load(EdgeSettings, ["--port", "9001"]).port == 9001


def test_compose_profile(monkeypatch):
    config = load(EdgeSettings, ["--profile", "compose"])
    assert config.kafka.bootstrap == "kafka:9092" and config.host == "0.0.0.0"
    assert config.internal.host == "0.0.0.0" and config.gossip.probe_interval == LAN["probe_interval"]
    # A flag or variable still wins over the profile, inside a section too.
    monkeypatch.setenv("DRIVETRAIN_PROFILE", "compose")
    monkeypatch.setenv("DRIVETRAIN_GOSSIP_SECRET", "s3cret")
    config = load(EdgeSettings, ["--gossip.port", "7000"])
    assert (config.gossip.port, config.gossip.secret, config.gossip.host) == (7000, "s3cret", "0.0.0.0")
    with pytest.raises(SettingsError, match="profile"):
        load(EdgeSettings, ["--profile", "moon"])


def test_sections_nest_and_their_variables_name_them(monkeypatch):
    monkeypatch.setenv("DRIVETRAIN_ENGINE_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("DRIVETRAIN_ECHO_DELAY_MS", "20")
    monkeypatch.setenv("DRIVETRAIN_MAX_MODEL_LEN", "1024")
    monkeypatch.setenv("DRIVETRAIN_KAFKA_PORT", "9999")  # the local broker's setting: no service's
    worker = load(WorkerSettings, ["--engine.num-kv-blocks", "64", "--no-engine.enable-prefix-caching"])
    assert (worker.engine.max_num_seqs, worker.engine.num_kv_blocks, worker.engine.enable_prefix_caching) == (7, 64, False)
    assert (worker.echo.delay_ms, worker.max_model_len) == (20.0, 1024)
    assert InfraSettings().kafka_port == 9999 and worker.kafka.bootstrap == "127.0.0.1:9092"


def test_bad_values_are_named_as_flags():
    with pytest.raises(SettingsError) as info:
        load(WorkerSettings, ["--engine.max-num-seqs", "0"])
    assert "--engine.max-num-seqs (DRIVETRAIN_ENGINE_MAX_NUM_SEQS)" in str(info.value)
    with pytest.raises(SettingsError, match="--port"):
        load(EdgeSettings, ["--port", "eighty"])


def test_settings_are_frozen():
    config = load(EdgeSettings, [])
    with pytest.raises(ValueError):
        config.port = 1


def test_one_variable_per_setting_and_no_name_shadows_a_section():
    for cls in (EdgeSettings, WorkerSettings, RouterSettings, InfraSettings):
        docs = list(setting_docs(cls))
        assert len({doc.env for doc in docs}) == len(docs), cls
        sections = {doc.name.partition(".")[0] for doc in docs if "." in doc.name}
        top = [doc.name for doc in docs if "." not in doc.name]
        # With one split at the first "_", DRIVETRAIN_KAFKA_X could mean either.
        assert not [name for name in top if name.partition("_")[0] in sections], cls


def test_every_setting_is_documented_and_the_reference_is_current():
    for cls in (ServiceSettings, EdgeSettings, WorkerSettings, RouterSettings, InfraSettings):
        assert [doc.name for doc in setting_docs(cls) if not doc.help] == [], cls
    text = DOC.read_text()
    assert rewritten(text) == text, "run `.venv/bin/drivetrain settings --write docs/configuration.md`"


def test_router_edge_peers():
    config = load(RouterSettings, ["--edges", "edge-0=127.0.0.1:9180,edge-1=127.0.0.1:9181"])
    assert config.edge_addresses() == {"edge-0": ("127.0.0.1", 9180), "edge-1": ("127.0.0.1", 9181)}
    with pytest.raises(ValueError):
        load(RouterSettings, ["--edges", "edge-0"]).edge_addresses()

"""The secure infrastructure's pure parts: its own ports, each role's grants, an ACL file with no clear password."""

from shared.infra.credentials import InfraSecrets
from shared.infra.permissions import (
    Operation,
    ResourceType,
    Role,
    kafka_grants,
    redis_acl_file,
    usage_meter_group,
)
from shared.infra.settings import InfraSettings
from shared.topics import TopicLayout


def test_secure_mode_has_its_own_ports_and_state_unless_told_otherwise():
    plain, secure = InfraSettings(), InfraSettings(secure=True)
    assert (secure.kafka_port, secure.kafka_controller_port, secure.redis_ports[0]) == (9192, 9193, 7100)
    assert secure.kafka_dir != plain.kafka_dir and secure.kafka_lib_dir == plain.kafka_lib_dir
    assert InfraSettings(secure=True, kafka_port=9300).kafka_port == 9300


def test_only_workers_write_tokens_and_only_edges_write_requests():
    topics = TopicLayout(prefix="p")
    grants = kafka_grants(topics)

    def who(name: str, operation: Operation) -> set[Role]:
        return {g.role for g in grants if g.name == name and g.operation is operation}

    assert who(topics.tokens, Operation.WRITE) == {Role.WORKER}
    assert who(topics.tokens, Operation.READ) == {Role.ROUTER}
    assert who(topics.requests, Operation.WRITE) == {Role.EDGE}
    assert who(topics.kv_events, Operation.WRITE) == {Role.WORKER}
    assert who(topics.kv_events, Operation.READ) == {Role.EDGE}
    assert {g.name for g in grants if g.resource is ResourceType.GROUP} == {"p-workers", "p-routers", "p-usage-meter"}


def test_workers_and_edges_report_usage_and_routers_count_it():
    topics = TopicLayout(prefix="p")
    grants = kafka_grants(topics)
    on_usage = {(g.role, g.operation) for g in grants if g.name == topics.usage}
    assert on_usage == {(Role.WORKER, Operation.WRITE), (Role.EDGE, Operation.WRITE), (Role.ROUTER, Operation.READ)}
    assert {g.role for g in grants if g.name == usage_meter_group(topics)} == {Role.ROUTER}
    router = next(line for line in redis_acl_file(InfraSecrets.generate().redis_sha256()).splitlines() if line.startswith("user router "))
    assert "~usage:*" in router and "+eval" in router and "+hincrby" in router


def test_the_acl_file_turns_the_default_user_off_and_holds_only_hashes():
    found = InfraSecrets.generate()
    text = redis_acl_file(found.redis_sha256())
    assert text.splitlines()[0].startswith("user default off")
    assert not any(password in text for password in found.redis.values())
    worker = next(line for line in text.splitlines() if line.startswith("user worker "))
    assert "%R~claim:*" in worker and "+@all" not in worker and "flushall" not in worker

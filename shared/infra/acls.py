"""Grants the roles' Kafka ACLs (`permissions.kafka_grants`) on the secure broker.

aiokafka's admin client has no ACL calls, but its protocol module has the CreateAcls
request: one request per binding, sent through the admin client's connection. Adding a
binding that exists already is a no-op on the broker, so granting is idempotent.
"""

from __future__ import annotations

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import for_code
from aiokafka.protocol.admin import CreateAclsRequest

from shared.infra.errors import InfraError
from shared.infra.permissions import KafkaGrant, kafka_grants
from shared.topics import TopicLayout

PATTERN_LITERAL = 3
PERMISSION_ALLOW = 3
ANY_HOST = "*"


def create_acls_request(grant: KafkaGrant) -> CreateAclsRequest:
    return CreateAclsRequest(
        resource_type=grant.resource,
        resource_name=grant.name,
        resource_pattern_type_filter=PATTERN_LITERAL,
        principal=grant.principal,
        host=ANY_HOST,
        operation=grant.operation,
        permission_type=PERMISSION_ALLOW,
    )


async def grant_roles(admin: AIOKafkaAdminClient, topics: TopicLayout) -> list[KafkaGrant]:
    """Allow each role what it needs on this layout's topics and groups; raise if refused."""
    grants = kafka_grants(topics)
    for grant in grants:
        # The public admin API lacks ACLs; `_send_request` is how its own calls are sent.
        response = await admin._send_request(create_acls_request(grant))
        for code, message in response.creation_responses:
            if code:
                raise InfraError(f"could not grant {grant}: {for_code(code).__name__} {message or ''}")
    return grants

#!/bin/bash
# Creates the topics as admin and grants each role what it needs (shared/infra/permissions.py
# says the same for the local secure broker).
set -euo pipefail
umask 077
cat >/tmp/admin.properties <<PROPERTIES
security.protocol=SASL_PLAINTEXT
sasl.mechanism=SCRAM-SHA-512
sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required username="admin" password="${KAFKA_ADMIN_PASSWORD:?}";
PROPERTIES
kafka=(--bootstrap-server kafka:9092 --command-config /tmp/admin.properties)
prefix=drivetrain
for spec in requests:8 tokens:8 control:1 dead-letter:1 usage:4 kv-events:1; do
  /opt/kafka/bin/kafka-topics.sh "${kafka[@]}" --create --if-not-exists \
    --topic "$prefix.${spec%%:*}" --partitions "${spec##*:}" --replication-factor 1
done
acl() { /opt/kafka/bin/kafka-acls.sh "${kafka[@]}" --add --allow-principal "User:$1" "${@:2}"; }
acl edge --operation Write --topic "$prefix.requests" --topic "$prefix.control"
acl worker --operation Read --topic "$prefix.requests" --topic "$prefix.control"
acl worker --operation Write --topic "$prefix.tokens" --topic "$prefix.dead-letter"
acl worker --operation Read --group "$prefix-workers"
acl router --operation Read --topic "$prefix.tokens" --group "$prefix-routers"
acl router --operation Write --topic "$prefix.dead-letter"
acl edge --operation Write --topic "$prefix.usage"
acl worker --operation Write --topic "$prefix.usage"
acl router --operation Read --topic "$prefix.usage" --group "$prefix-usage-meter"
acl worker --operation Write --topic "$prefix.kv-events"
acl edge --operation Read --topic "$prefix.kv-events"
acl edge --operation Write --topic "$prefix.dead-letter"

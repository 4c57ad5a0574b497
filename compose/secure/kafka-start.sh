#!/bin/bash
# The secure stack's Kafka (compose/docker-compose.secure.yml): SASL/SCRAM-SHA-512 for
# clients, SASL/PLAIN on the controller listener, StandardAuthorizer with ACLs per role.
# Passwords come from the environment (compose/secure.env); the SCRAM users are added
# when the storage is first formatted, as KRaft requires.
set -euo pipefail
for name in KAFKA_ADMIN_PASSWORD KAFKA_CONTROLLER_PASSWORD KAFKA_EDGE_PASSWORD KAFKA_WORKER_PASSWORD KAFKA_ROUTER_PASSWORD; do
  [ -n "${!name:-}" ] || { echo "kafka-start: $name is not set (see compose/secure.env.example)" >&2; exit 2; }
done
config=/tmp/server.properties data=/var/lib/kafka/data
umask 077
cat >"$config" <<PROPERTIES
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@kafka:9093
listeners=SASL_PLAINTEXT://:9092,CONTROLLER://:9093
advertised.listeners=SASL_PLAINTEXT://kafka:9092
controller.listener.names=CONTROLLER
inter.broker.listener.name=SASL_PLAINTEXT
listener.security.protocol.map=CONTROLLER:SASL_PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT
sasl.enabled.mechanisms=SCRAM-SHA-512
sasl.mechanism.inter.broker.protocol=SCRAM-SHA-512
listener.name.sasl_plaintext.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required username="admin" password="${KAFKA_ADMIN_PASSWORD}";
sasl.mechanism.controller.protocol=PLAIN
listener.name.controller.sasl.enabled.mechanisms=PLAIN
listener.name.controller.plain.sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule required username="controller" password="${KAFKA_CONTROLLER_PASSWORD}" user_controller="${KAFKA_CONTROLLER_PASSWORD}";
authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer
allow.everyone.if.no.acl.found=false
super.users=User:admin;User:controller
log.dirs=${data}
offsets.topic.replication.factor=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
group.initial.rebalance.delay.ms=0
auto.create.topics.enable=false
PROPERTIES
if [ ! -f "$data/meta.properties" ]; then
  /opt/kafka/bin/kafka-storage.sh format -c "$config" -t "$(/opt/kafka/bin/kafka-storage.sh random-uuid)" \
    --add-scram "SCRAM-SHA-512=[name=admin,password=${KAFKA_ADMIN_PASSWORD}]" \
    --add-scram "SCRAM-SHA-512=[name=edge,password=${KAFKA_EDGE_PASSWORD}]" \
    --add-scram "SCRAM-SHA-512=[name=worker,password=${KAFKA_WORKER_PASSWORD}]" \
    --add-scram "SCRAM-SHA-512=[name=router,password=${KAFKA_ROUTER_PASSWORD}]"
fi
# The admin's client login, for the health check and kafka-init.
cat >/tmp/admin.properties <<PROPERTIES
security.protocol=SASL_PLAINTEXT
sasl.mechanism=SCRAM-SHA-512
sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required username="admin" password="${KAFKA_ADMIN_PASSWORD}";
PROPERTIES
exec /opt/kafka/bin/kafka-server-start.sh "$config"

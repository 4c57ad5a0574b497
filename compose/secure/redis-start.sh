#!/bin/sh
# A node of the secure stack's Redis Cluster: ACL users per role (as shared/infra/permissions.py
# gives the local secure cluster), the default user off, replication logged in as admin.
set -eu
for name in REDIS_ADMIN_PASSWORD REDIS_EDGE_PASSWORD REDIS_WORKER_PASSWORD REDIS_ROUTER_PASSWORD; do
  eval "value=\${$name:-}"
  [ -n "$value" ] || { echo "redis-start: $name is not set (see compose/secure.env.example)" >&2; exit 2; }
done
umask 077
client="+auth +hello +ping +readonly +command +cluster|slots +cluster|shards +cluster|nodes +client|setname +client|setinfo"
cat >/tmp/users.acl <<ACL
user default off resetkeys resetchannels -@all
user admin on >$REDIS_ADMIN_PASSWORD ~* &* +@all
user edge on >$REDIS_EDGE_PASSWORD resetchannels ~route:* ~response:* +hset +expire +hmget +hincrby +del +get +set $client
user worker on >$REDIS_WORKER_PASSWORD resetchannels %R~claim:* +get $client
user router on >$REDIS_ROUTER_PASSWORD resetchannels %R~route:* %W~claim:* +hmget +set $client
ACL
printf 'aclfile /tmp/users.acl\nmasteruser admin\nmasterauth %s\n' "$REDIS_ADMIN_PASSWORD" >/tmp/secure.conf
exec redis-server /tmp/secure.conf --port 7000 --cluster-enabled yes --cluster-config-file nodes.conf \
  --cluster-node-timeout 2000 --cluster-announce-hostname "$HOSTNAME" \
  --cluster-preferred-endpoint-type hostname --appendonly no

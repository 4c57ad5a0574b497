"""Local Kafka broker and Redis Cluster for development and tests (`drivetrain infra`).

`settings` says where they run, `command` brings them up and down (`ensure_up` for callers
in Python), `kafka`, `redis_cluster` and `topics` do the work.
"""

"""Kafka topic names under one prefix, and their partition counts: the `topics` settings section."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from shared.settings import Section

Partitions = Annotated[int, Field(ge=1)]

# The largest client frame an edge takes, and the largest record every topic and producer take:
# a request re-encoded as msgpack is never larger than the JSON it came in, and what it adds (ids,
# tenant, sampling fields, record and batch headers) is far under the headroom. A dead letter
# wraps a record in a few dozen bytes more. Kafka's own default (1 MiB) would refuse some of them.
MAX_FRAME_BYTES = 1024 * 1024
MAX_RECORD_BYTES = MAX_FRAME_BYTES + 64 * 1024
TOPIC_CONFIGS = {"max.message.bytes": str(MAX_RECORD_BYTES)}


class TopicLayout(Section):
    """Requests spread over workers and tokens over routers, so those two get many partitions;
    control and dead-letter traffic is small and needs one."""

    prefix: str = "drivetrain"
    """prefix of the Kafka topics (PREFIX.requests, .tokens, .control, .dead-letter, .usage, .kv-events) and consumer groups; it also names the gossip cluster, so fleets with different prefixes never merge"""
    requests_partitions: Partitions = 8
    """partitions of PREFIX.requests, where a fleet creates its topics"""
    tokens_partitions: Partitions = 8
    """partitions of PREFIX.tokens"""
    control_partitions: Partitions = 1
    """partitions of PREFIX.control"""
    dead_letter_partitions: Partitions = 1
    """partitions of PREFIX.dead-letter"""
    usage_partitions: Partitions = 4
    """partitions of PREFIX.usage: one record per finished request, keyed by request id"""
    kv_events_partitions: Partitions = 1
    """partitions of PREFIX.kv-events: workers' prefix-cache blocks stored and evicted, read by every edge"""

    @property
    def requests(self) -> str:
        return f"{self.prefix}.requests"

    @property
    def tokens(self) -> str:
        return f"{self.prefix}.tokens"

    @property
    def control(self) -> str:
        return f"{self.prefix}.control"

    @property
    def dead_letter(self) -> str:
        return f"{self.prefix}.dead-letter"

    @property
    def usage(self) -> str:
        return f"{self.prefix}.usage"

    @property
    def kv_events(self) -> str:
        return f"{self.prefix}.kv-events"

    def partitions(self) -> dict[str, int]:
        return {
            self.requests: self.requests_partitions,
            self.tokens: self.tokens_partitions,
            self.control: self.control_partitions,
            self.dead_letter: self.dead_letter_partitions,
            self.usage: self.usage_partitions,
            self.kv_events: self.kv_events_partitions,
        }

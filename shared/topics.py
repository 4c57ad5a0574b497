"""Kafka topic names and partition counts, shared by every service and by the infrastructure."""

from dataclasses import dataclass

REQUESTS = "drivetrain.requests"
TOKENS = "drivetrain.tokens"
CONTROL = "drivetrain.control"
DEAD_LETTER = "drivetrain.dead-letter"


@dataclass(frozen=True)
class TopicLayout:
    """Topic names under one prefix (tests use their own) and their partition counts.

    Requests spread over workers and tokens over routers, so those two get many
    partitions; control and dead-letter traffic is small and needs one.
    """

    prefix: str = "drivetrain"
    requests_partitions: int = 8
    tokens_partitions: int = 8
    control_partitions: int = 1
    dead_letter_partitions: int = 1

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

    def partitions(self) -> dict[str, int]:
        return {
            self.requests: self.requests_partitions,
            self.tokens: self.tokens_partitions,
            self.control: self.control_partitions,
            self.dead_letter: self.dead_letter_partitions,
        }

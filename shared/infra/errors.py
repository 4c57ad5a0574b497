"""Why the local infrastructure could not be brought to the state asked for."""


class InfraError(RuntimeError):
    """A component could not be brought to the state asked for; the message says why."""


class MissingPrerequisite(InfraError):
    """A tool the infrastructure needs (java, mvn, redis-server) is not installed."""

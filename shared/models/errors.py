"""Why a model cannot be served here: a name that names none, a context it does not have, missing files."""


class ModelError(ValueError):
    """The message says what was asked for and what this machine can serve instead."""

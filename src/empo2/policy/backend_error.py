"""The rollout backends' error type, in a module of its own so every backend can raise it without importing the
others."""

from empo2.errors import UserError


class BackendError(UserError, RuntimeError):
    """A rollout backend that cannot be used here (e.g. vLLM not installed); the CLI exits with code 2."""

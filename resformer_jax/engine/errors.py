"""The engine's error: what every part of the engine (the scheduler, the page pool, the runner) raises for a
request or a setting that cannot work."""

from resformer_jax.errors import UserError


class EngineError(UserError):
    """A request or an engine setting that cannot work; the message says what to change."""

"""Errors the runtime raises; each carries enough context to act on without a traceback."""


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class ModelLoadError(EngineError):
    """A model directory or file is missing, corrupt or of an unsupported architecture."""


class RequestError(EngineError):
    """A request can never be served as asked (too long, bad sampling values)."""

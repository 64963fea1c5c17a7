"""activator: a request-throttling reverse proxy for concurrency-limited backends."""

__version__ = "0.1.0"

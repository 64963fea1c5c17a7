"""Config values for the in-process tests (core and races): one pod, one service."""

from __future__ import annotations

from typing import Any

from activator.core.config import PodConfig, ServiceConfig


def pod(address: str, drain: bool = False) -> PodConfig:
    host, port = address.rsplit(":", 1)
    return PodConfig(address=address, host=host, port=int(port), drain=drain)


def svc(*pods: str | PodConfig, cc: int = 1, **kw: Any) -> ServiceConfig:
    """Service ``api`` with these pods (addresses or PodConfig values)."""
    kw.setdefault("hosts", ("api.example.com",))
    return ServiceConfig(
        name="api",
        container_concurrency=cc,
        pods=tuple(p if isinstance(p, PodConfig) else pod(p) for p in pods),
        **kw,
    )

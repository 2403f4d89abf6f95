"""Weight transfer trainer -> generators: transports by name behind one interface.

`shared.transport.base` holds what they share (manifests, checksums, verification, the served
versions, the `WeightServer`/`WeightClient` interfaces), `shared.transport.wire` the TCP control
channel's frames; each transport is one module: `tcp` (plain sockets, the fallback) and `ucx`
(ucxx; imported on first use, so `shared.transport` imports without ucxx). No pickle anywhere:
requests and headers are msgpack, payloads are raw bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import Any

from shared.transport.base import (
    DEFAULT_CHUNK_BYTES,
    Buffer,
    ChecksumError,
    WeightClient,
    WeightServer,
    bad_chunks,
    build_manifest,
    chunk_checksums,
    verify_and_repair,
    version_checksum,
)
from shared.transport.tcp import TcpWeightClient, TcpWeightServer

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "TRANSPORTS",
    "Buffer",
    "ChecksumError",
    "TcpWeightClient",
    "TcpWeightServer",
    "WeightClient",
    "WeightServer",
    "bad_chunks",
    "build_manifest",
    "chunk_checksums",
    "make_client",
    "make_server",
    "verify_and_repair",
    "version_checksum",
]


def _ucx_server(**kw: Any) -> WeightServer:
    return import_module("shared.transport.ucx").UcxWeightServer(**kw)


def _ucx_client(**kw: Any) -> WeightClient:
    return import_module("shared.transport.ucx").UcxWeightClient(**kw)


# name -> (server factory, client factory)
TRANSPORTS: dict[str, tuple[Callable[..., WeightServer], Callable[..., WeightClient]]] = {
    "tcp": (TcpWeightServer, TcpWeightClient),
    "ucx": (_ucx_server, _ucx_client),
}


def _transport(name: str) -> tuple[Callable[..., WeightServer], Callable[..., WeightClient]]:
    if name not in TRANSPORTS:
        raise ValueError(f"unknown weight transport '{name}'; valid: {sorted(TRANSPORTS)}")
    return TRANSPORTS[name]


def make_server(name: str, **kwargs: Any) -> WeightServer:
    """The trainer's server of transport `name` (kwargs: host, port, keep, advertise_host, ...).

    Raises:
        ValueError: an unknown name; the message lists the valid ones.
    """
    return _transport(name)[0](**kwargs)


def make_client(name: str, **kwargs: Any) -> WeightClient:
    """A generator's client of transport `name` (kwargs: retries, timeout_s, piece_bytes; raises
    like `make_server`)."""
    return _transport(name)[1](**kwargs)

"""The old home of the UCX transport, now `shared.transport.ucx`: its names stay importable from
here for broker.bench_transfer and deploy/gpu_transfer_check.py until they import the new one."""

from shared.transport.ucx import (
    DEFAULT_PIECE_BYTES,
    UcxWeightClient,
    UcxWeightServer,
    ucx_options,
)

__all__ = ["DEFAULT_PIECE_BYTES", "UcxWeightClient", "UcxWeightServer", "ucx_options"]

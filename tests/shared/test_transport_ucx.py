"""UCX transport beyond the shared transport tests: the real deployment shape (trainer process
serves, generator processes fetch), the raw path, a client that dies mid-transfer, and imports."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import xxhash

pytest.importorskip("ucxx")

from shared.schema import Manifest  # noqa: E402
from shared.transport import build_manifest, make_server  # noqa: E402
from shared.transport.ucx import UcxWeightClient, UcxWeightServer, ucx_options  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CHUNK = 64 * 1024


def version(v: int, nbytes: int) -> tuple[Manifest, np.ndarray]:
    buf = np.random.default_rng(v).integers(0, 256, size=nbytes, dtype=np.uint8)
    return build_manifest(v, [("w", [nbytes], "uint8", nbytes)], buf, chunk_bytes=CHUNK), buf


@pytest.fixture
def server():
    srv = UcxWeightServer(port=0, keep=3, timeout_s=5)
    try:
        yield srv
    finally:
        threading.Thread(target=srv.close, daemon=True).start()


FETCHER = """
    import sys, xxhash
    from shared.schema import Manifest
    from shared.transport import make_client
    address, manifests = sys.argv[1], sys.argv[2:]
    for _ in range(2):  # repeated fetches in one process, fresh client each time (as the generator does)
        for raw in manifests:
            m = Manifest.model_validate_json(raw)
            client = make_client("ucx")
            buf = client.fetch(address, m)
            client.close()
            print(m.version, xxhash.xxh3_64_hexdigest(buf), flush=True)
"""


def test_fetch_from_separate_processes(server: UcxWeightServer) -> None:
    """Trainer process serves; two generator processes fetch at the same time, twice each."""
    served = [version(v, 3 * 1024 * 1024 + 17) for v in (1, 2)]
    for m, buf in served:
        server.serve(m, buf)
    args = [server.address, *(m.model_dump_json() for m, _ in served)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(FETCHER), *args],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    want = [f"{m.version} {xxhash.xxh3_64_hexdigest(buf)}" for m, buf in served] * 2
    for proc in procs:
        out, err = proc.communicate(timeout=120)  # also proves the child exits (no hang at exit)
        assert proc.returncode == 0, err[-3000:]
        assert out.split("\n")[:-1] == want


def test_fetch_into_a_preallocated_buffer(server: UcxWeightServer) -> None:
    m, buf = version(3, 200_001)
    server.serve(m, buf)
    client = UcxWeightClient(piece_bytes=65_536)  # several pieces in flight, the last one short
    out = np.zeros(m.total_bytes, dtype=np.uint8)
    client.fetch_into(server.address, m, out)
    assert np.array_equal(out, buf)
    with pytest.raises(ValueError, match="does not match"):
        client.fetch_into(server.address, m, out[:-1])


def test_zero_byte_version(server: UcxWeightServer) -> None:
    buf = np.empty(0, dtype=np.uint8)
    m = build_manifest(4, [], buf)
    server.serve(m, buf)
    assert UcxWeightClient().fetch(server.address, m).nbytes == 0


def test_client_dying_mid_transfer_does_not_wedge_the_server(server: UcxWeightServer) -> None:
    """A generator that asks for a version and dies before receiving: the server notices the closed
    control socket (UCX, error handling off, would not), well before its 5 s send timeout, drops
    that connection and keeps serving everyone else."""
    m, buf = version(5, 1024 * 1024)
    server.serve(m, buf)
    dier = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
            import os, socket
            from shared.transport.ucx import get_worker
            from shared.transport.wire import recv_msg, send_msg
            sock = socket.create_connection(("127.0.0.1", {server.port}))
            send_msg(sock, {{"worker": get_worker().address}})
            assert recv_msg(sock)["ok"]
            send_msg(
                sock,
                {{"version": {m.version}, "offset": 0, "length": {m.total_bytes}, "tag": 1 << 24, "piece": 65536}},
            )
            assert recv_msg(sock)["ok"]
            os._exit(0)  # never posts the receives
        """),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert dier.returncode == 0, dier.stderr[-3000:]
    got = UcxWeightClient(timeout_s=20).fetch(server.address, m)
    assert np.array_equal(got, buf)
    t0 = time.monotonic()
    while server._conns and time.monotonic() - t0 < 3:
        time.sleep(0.05)
    assert not server._conns  # the dead client's handler let go (endpoint closed, buffer released)


def test_make_server_by_name_is_the_ucx_server() -> None:
    srv = make_server("ucx", port=0)
    try:
        assert isinstance(srv, UcxWeightServer) and srv.name == "ucx"
    finally:
        threading.Thread(target=srv.close, daemon=True).start()


def test_environment_overrides_our_ucx_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("UCX_TCP_TX_SEG_SIZE", raising=False)
    assert ucx_options()["TCP_TX_SEG_SIZE"] == "512k"
    monkeypatch.setenv("UCX_TCP_TX_SEG_SIZE", "64k")
    assert "TCP_TX_SEG_SIZE" not in ucx_options()


def test_shared_imports_without_ucxx() -> None:
    """The registry names "ucx" without loading ucxx; it is imported on the first server/client."""
    code = (
        "import sys\n"
        "import shared.transport, shared.transport.ucx\n"
        "assert 'ucx' in shared.transport.TRANSPORTS\n"
        "print(sorted(m for m in ('ucxx', 'torch', 'vllm') if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"

"""Watchers ride out an API outage (asyncrl.http_retry.get_json) against a real HTTP server that
answers 503 (then refuses connections) for a while before it recovers."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from asyncrl.http_retry import ApiUnavailable, get_json

pytestmark = [pytest.mark.hostile]


class _Flaky(BaseHTTPRequestHandler):
    down_until = 0.0

    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path == "/missing":
            code, body = 404, {"error": "no such job"}
        elif time.monotonic() < _Flaky.down_until:
            code, body = 503, None
        else:
            code, body = 200, {"state": "running"}
        raw = b"<html>unavailable</html>" if body is None else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Flaky)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_503s_are_waited_out_and_4xx_returned(server):
    _Flaky.down_until = time.monotonic() + 1.5
    t0 = time.monotonic()
    assert get_json(httpx.get, f"{server}/jobs/x", outage_s=30, timeout=5) == {"state": "running"}
    assert 1.4 < time.monotonic() - t0 < 10
    assert get_json(httpx.get, f"{server}/missing", timeout=5) == {"error": "no such job", "status_code": 404}


def test_an_outage_past_the_budget_raises(server):
    _Flaky.down_until = time.monotonic() + 60
    with pytest.raises(ApiUnavailable, match="stayed unavailable"):
        get_json(httpx.get, f"{server}/jobs/x", outage_s=1.0, timeout=5)
    with pytest.raises(ApiUnavailable):  # nothing listening at all
        get_json(httpx.get, "http://127.0.0.1:9/jobs/x", outage_s=1.0, timeout=1)

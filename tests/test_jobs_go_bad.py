"""Jobs whose rewards all fail say so (issue 31), on the session's standing fleet: before, a job whose
scorer answered 500 for its whole run scored every sample `reward_status` error with reward 0 and
ended `finished`, verify ok, nothing flagged. Now it fails once `reward_limits.fail_after_error_steps`
steps in a row had every reward fail, the most common failure in its error, and GET /jobs/{id},
`asyncrl status` and the status page show its reward error fraction. Figures:
`all_rewards_error_jobs_finished` in results/hostile.json (0 expected)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from hostile_results import record_hostile
from typer.testing import CliRunner

from asyncrl.cli import app

pytestmark = [pytest.mark.hostile, pytest.mark.integration, pytest.mark.slow]


class _Down(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = b"scorer is down"
        self.send_response(500)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def scorer_down() -> Iterator[str]:
    """An HTTP scorer that answers every request 500; yields its URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Down)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/score"
    finally:
        server.shutdown()
        server.server_close()


def test_a_job_whose_http_scorer_answers_500_fails_saying_why(fleet, scorer_down) -> None:
    reward = {"kind": "http", "url": scorer_down, "retries": 0, "timeout_s": 10}
    job_id = fleet.submit("scorer-500", steps=4, reward=reward, reward_limits={"fail_after_error_steps": 2})
    job = fleet.wait(job_id)
    record_hostile(all_rewards_error_jobs_finished=int(job["state"] == "finished"))
    assert job["state"] == "failed", job
    assert job["step"] == 2  # the second step in a row of nothing but errors
    assert f"all rewards errored for 2 steps: POST {scorer_down}: HTTP 500 'scorer is down'" in job["error"]
    assert "reward_limits.fail_after_error_steps 2" in job["error"]
    assert set(job["reward_errors"]["by_status"]) == {"error"} and job["reward_errors"]["fraction"] == 1.0
    assert job["last_metrics"]["reward/error_fraction"] == 1.0
    shown = CliRunner().invoke(app, ["status", job_id, "--api", fleet.api])
    assert shown.exit_code == 0, shown.output
    assert "reward errors: 100.0% of" in shown.stderr
    assert fleet.alive()  # one job's fault: the fleet goes on


def test_a_job_whose_python_scorer_raises_fails_by_default(fleet) -> None:
    """The defaults (fail_after_error_steps 5): a 2-step job fails at its last step rather than end
    `finished`."""
    plugin = fleet.tmp / "raising_reward.py"
    plugin.write_text("def score(completion, answer):\n    raise RuntimeError('the grader lost its key')\n")
    job = fleet.wait(fleet.submit("scorer-raises", steps=2, reward=f"{plugin}:score"))
    record_hostile(all_rewards_error_jobs_finished=int(job["state"] == "finished"))
    assert job["state"] == "failed", job
    assert "all rewards errored for 2 steps: " in job["error"]
    assert "RuntimeError: the grader lost its key" in job["error"]
    assert job["reward_errors"]["fraction"] == 1.0
    assert fleet.alive()

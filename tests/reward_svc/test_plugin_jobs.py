"""A real job on the session's standing fleet whose reward plug-in calls `sys.exit(0)` at import
(issue 31): it used to end the reward service silently (exit 0) and leave the job waiting at step
0. Now the import runs in a child first: the job fails with the reason, and the fleet's services
all stay up for the next job."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.hostile, pytest.mark.integration]


def test_a_plugin_that_exits_at_import_fails_its_job_and_the_fleet_goes_on(fleet) -> None:
    path = fleet.tmp / "exits_at_import.py"
    path.write_text("import sys\n\nsys.exit(0)\n\n\ndef score(completion, answer):\n    return 1.0\n")
    job_id = fleet.submit("plugin-exits", steps=2, reward={"kind": "python", "function": f"{path}:score"})
    job = fleet.wait(job_id, timeout=240)
    assert job["state"] == "failed", job
    assert "reward" in job["error"] and "it called sys.exit(0)" in job["error"] and str(path) in job["error"]
    assert job["step"] == 0
    assert fleet.alive(), "a fleet service exited"

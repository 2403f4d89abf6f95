"""The id grammar (shared.ids): each id built, and read back, as the ledger and the trainer expect."""

from __future__ import annotations

import pytest

from shared import ids


def test_training_group_ids_carry_the_job_the_run_and_the_feed_order() -> None:
    assert ids.id_prefix("job-1") == "job-1"
    assert ids.id_prefix("job-1", "r2") == "job-1/r2"
    gid = ids.train_group_id(ids.id_prefix("job-1", "r2"), 17)
    assert gid == "job-1/r2/g17"
    assert ids.group_seq(gid) == 17
    assert sorted(["j/g10", "j/g9", "j/g100"], key=ids.group_seq) == ["j/g9", "j/g10", "j/g100"]


def test_group_seq_refuses_what_is_not_a_training_group() -> None:
    with pytest.raises(ValueError, match="not a training group id"):
        ids.group_seq("job-1/e3")
    with pytest.raises(ValueError):
        ids.group_seq("job-1/gx")


def test_eval_ids_round_trip() -> None:
    rnd = ids.eval_round_id("job-1/r2", 3)
    assert rnd == "job-1/r2/e3"
    group = ids.eval_group_id(rnd, 41)
    assert group == "job-1/r2/e3/41"
    assert ids.eval_round(group) == rnd


def test_sample_and_dead_letter_ids() -> None:
    assert ids.sample_id("job-1/g4", 0) == "job-1/g4/0"
    assert ids.sample_ids("job-1/g4", 3) == ["job-1/g4/0", "job-1/g4/1", "job-1/g4/2"]
    assert ids.sample_ids("job-1/g4", 0) == []
    assert ids.dead_letter_id("prompts", "17-0") == "prompts/17-0"


def test_policy_version_and_control_ids() -> None:
    assert ids.policy_version_id("job-1", 12) == "job-1/v12"
    assert ids.control_id("pause", "ab12cd34") == "pause-ab12cd34"
    assert ids.control_id("end", "40") == "end-40"

"""The id grammar: how group, sample, evaluation and dead-letter ids are built and read back.

    prefix          {job}                     or {job}/{trainer run}  (a restarted trainer's new run)
    training group  {prefix}/g{seq}           seq: the feed counter, in feed order
    eval round      {prefix}/e{round}
    eval group      {eval round}/{prompt index}
    sample          {group id}/{sample index}  (a group's msg_id is its group id)
    dead letter     {stream}/{entry id}
    policy version  {job}/v{version}
    control         {command}-{nonce}          (the API's commands; the trainer's job end: end-{step})

Every id starts with the job id: ids are the ledger's idempotency keys and must be unique across
all jobs sharing one database. Pure functions, no I/O.
"""

from __future__ import annotations


def id_prefix(job_id: str, run_id: str = "") -> str:
    """What every group id of one trainer run starts with; a restarted trainer (new `run_id`)
    never reuses its predecessor's ids."""
    return f"{job_id}/{run_id}" if run_id else job_id


def train_group_id(prefix: str, seq: int) -> str:
    """The id of the `seq`-th training group fed under `prefix`."""
    return f"{prefix}/g{seq}"


def group_seq(group_id: str) -> int:
    """The feed counter of a training group id `{prefix}/g{seq}`: the order groups were fed in,
    across trainer restarts too (a resumed feeder continues the count).

    Raises:
        ValueError: `group_id` is not a training group id.
    """
    _, _, last = group_id.rpartition("/")
    if not last.startswith("g"):
        raise ValueError(f"{group_id!r} is not a training group id ('{{prefix}}/g{{seq}}')")
    return int(last[1:])


def eval_round_id(prefix: str, n: int) -> str:
    """The id of the `n`-th evaluation round fed under `prefix`."""
    return f"{prefix}/e{n}"


def eval_group_id(round_id: str, prompt_index: int) -> str:
    """The group of one problem of an evaluation round."""
    return f"{round_id}/{prompt_index}"


def eval_round(group_id: str) -> str:
    """The eval round an eval group belongs to: `{prefix}/e{round}/{prompt index}` -> `{prefix}/e{round}`."""
    return group_id.rsplit("/", 1)[0]


def sample_id(group_msg_id: str, sample_index: int) -> str:
    """The msg_id of one sample (rollout, scored) of a group."""
    return f"{group_msg_id}/{sample_index}"


def sample_ids(group_id: str, size: int) -> list[str]:
    """Every sample's msg_id of a group of `size`, in sample order."""
    return [sample_id(group_id, i) for i in range(size)]


def dead_letter_id(stream: str, entry_id: str) -> str:
    """The msg_id of the dead letter of entry `entry_id` of `stream`."""
    return f"{stream}/{entry_id}"


def policy_version_id(job_id: str, version: int) -> str:
    """The msg_id of the announcement of policy `version` (re-done steps re-announce the same id)."""
    return f"{job_id}/v{version}"


def control_id(command: str, nonce: str) -> str:
    """The msg_id of one control command; `nonce` tells two sends of the same command apart."""
    return f"{command}-{nonce}"

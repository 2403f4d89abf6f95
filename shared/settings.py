"""Per-service settings from the environment (pydantic-settings, one prefix per service).

Connection URLs are shared by every service and read without a prefix (`REDIS_URL`,
`DATABASE_URL`, `JOB_ID`); service knobs carry the service prefix (`GEN_`, `REWARD_`,
`TRAINER_`, `BROKER_`).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from shared.tracking import TrackingSink


def _default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class CommonSettings(BaseSettings):
    model_config = SettingsConfigDict(extra="ignore", frozen=True)

    redis_url: str | None = Field(
        None,
        validation_alias=AliasChoices("REDIS_URL", "redis_url"),
        description="Redis URL; unset: a reachable local Redis on 6379, else a private embedded server. "
        "redis+cluster://host:port (or rediss+cluster://): a Redis Cluster, any node as the seed.",
    )
    database_url: str = Field(
        "sqlite:///runs/ledger.db",
        validation_alias=AliasChoices("DATABASE_URL", "database_url"),
        description="SQLAlchemy URL of the ledger (SQLite by default, PostgreSQL in production).",
    )
    job_id: str | None = Field(
        None,
        validation_alias=AliasChoices("JOB_ID", "job_id"),
        description="Serve this one job, then exit; unset: serve the fleet's queue, one job after another, until "
        "stopped (broker/fleet.py).",
    )
    stream_prefix: str = Field(
        "rl:", validation_alias=AliasChoices("STREAM_PREFIX", "stream_prefix"), description="Key prefix for streams."
    )
    log_level: str = Field("INFO", validation_alias=AliasChoices("LOG_LEVEL", "log_level"))
    redis_outage_s: float = Field(
        600.0,
        gt=0,
        le=86_400,
        allow_inf_nan=False,
        validation_alias=AliasChoices("REDIS_OUTAGE_S", "redis_outage_s"),
        description="Seconds a Redis command keeps retrying through an outage before the service gives up.",
    )
    max_message_bytes: int = Field(
        8 * 1024 * 1024,
        ge=1024,
        validation_alias=AliasChoices("MAX_MESSAGE_BYTES", "max_message_bytes"),
        description="Stream entries larger than this go to the dead-letter stream.",
    )
    block_ms: int = Field(1000, ge=1, description="Blocking read timeout for stream consumers.")
    claim_idle_ms: int = Field(60_000, ge=1, description="Reclaim entries another consumer left pending this long.")
    max_deliveries: int = Field(5, ge=1, description="After this many deliveries a message is dead-lettered.")
    job_wait_s: float = Field(600.0, ge=0, description="How long a service waits at start-up for its job.")
    metrics_host: str = Field(
        "127.0.0.1",
        validation_alias=AliasChoices("METRICS_HOST", "metrics_host"),
        description="Interface a service's Prometheus port (its *_METRICS_PORT) listens on; loopback "
        "unless set (0.0.0.0 for a scraper on another host or container).",
    )


class PlacementSettings(BaseSettings):
    """Where a service started on its own (compose, systemd, `python -m`) places itself
    (shared/placement.py `place_self`): the roles on its node, and overrides. Read by every
    generator, reward and trainer process before anything else."""

    model_config = SettingsConfigDict(extra="ignore", frozen=True)

    placement: Literal["split", "colocated", "off"] = Field(
        "split",
        validation_alias=AliasChoices("NODE_PLACEMENT", "placement"),
        description="split: each role its own cores; colocated: generators and trainer share every core and GPU "
        "(jobs with placement colocated); off: do not place (the launcher did, or you pin by hand).",
    )
    roles: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        validation_alias=AliasChoices("NODE_ROLES", "roles"),
        description="Roles on this node, comma-separated (generator,reward,trainer); unset: the service does "
        "not place itself (compose and the systemd units set it).",
    )
    generators: int = Field(
        1,
        ge=1,
        le=1024,
        validation_alias=AliasChoices("NODE_GENERATORS", "generators"),
        description="Generator replicas on this node.",
    )
    replica: int | None = Field(
        None,
        ge=0,
        validation_alias=AliasChoices("GEN_REPLICA", "replica"),
        description="This generator's replica index on its node (0..NODE_GENERATORS-1); unset: it shares the "
        "generators' whole share with any other replica.",
    )
    gen_cpus: str | None = Field(
        None,
        validation_alias=AliasChoices("GEN_CPUS", "gen_cpus"),
        description="Cores of the generators (a cpuset list such as 0-3,8), replacing their share.",
    )
    trainer_cpus: str | None = Field(
        None,
        validation_alias=AliasChoices("TRAINER_CPUS", "trainer_cpus"),
        description="Cores of the trainer, replacing its share.",
    )
    reward_cpus: str | None = Field(
        None,
        validation_alias=AliasChoices("REWARD_CPUS", "reward_cpus"),
        description="Cores of the reward service, replacing its share.",
    )

    @field_validator("roles", mode="before")
    @classmethod
    def _split_roles(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = [r.strip() for r in v.split(",") if r.strip()]
        bad = sorted(set(v or []) - {"generator", "reward", "trainer", "broker", "admin"})
        if bad:
            raise ValueError(f"unknown role(s) {', '.join(bad)}; valid: generator, reward, trainer, broker, admin")
        return v

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> PlacementSettings:
        """These settings from `environ` (os.environ or a copy of it)."""
        keys = {
            "NODE_PLACEMENT": "placement",
            "NODE_ROLES": "roles",
            "NODE_GENERATORS": "generators",
            "GEN_REPLICA": "replica",
            "GEN_CPUS": "gen_cpus",
            "TRAINER_CPUS": "trainer_cpus",
            "REWARD_CPUS": "reward_cpus",
        }
        return cls.model_validate({f: environ[k] for k, f in keys.items() if environ.get(k, "") != ""})


class GeneratorSettings(CommonSettings):
    model_config = SettingsConfigDict(env_prefix="GEN_", extra="ignore", frozen=True)

    generator_id: str = Field(default_factory=_default_worker_id, description="Consumer name; unique per replica.")
    batch_groups: int = Field(
        16,
        ge=1,
        description="Prompt groups per generate call, counted in samples "
        "(groups x group size: a held-out round's one-sample groups fill a call together).",
    )
    gpu_memory_utilization: float = Field(0.2, gt=0, le=1, description="vLLM memory fraction (CPU: of NUMA RAM).")
    kv_cache_gib: int = Field(1, ge=1, description="vLLM CPU KV cache size (VLLM_CPU_KVCACHE_SPACE).")
    max_model_len: int = Field(256, ge=16, description="Context length given to vLLM.")
    dtype: str = Field("float32", description="Engine dtype; float32 keeps behaviour logprobs exact on CPU.")
    enforce_eager: bool = Field(True, description="Skip graph capture (faster start on CPU).")
    engine_in_process: bool = Field(
        True,
        description="Run vLLM's engine core and worker in the generator process (fast start); "
        "false for tensor parallelism.",
    )
    metrics_port: int = Field(0, ge=0, description="Prometheus port; 0 disables.")
    verify_atol: float = Field(
        1e-3, gt=0, description="Max |logprob| gap on the policy's probe after a swap (fp32: 1e-3; bf16: ~0.1)."
    )
    load_retries: int = Field(2, ge=0, description="Re-fetch and reload this often before a swap counts as failed.")
    relay_fanout: int = Field(
        0,
        ge=0,
        le=64,
        description="Relay fan-out of weights (ARCHITECTURE.md, 'Weights: relay fan-out'): 0 fetches every version "
        "from the trainer (N copies leave the trainer per version); k >= 1 makes the generators a tree with k "
        "children per relay, the first (by id) fetching from the trainer: one copy leaves the trainer. Each "
        "generator then serves what it verified; set the same k on every generator of a job.",
    )
    relay_host: str = Field(
        "127.0.0.1", description="Interface this generator's relay server listens on (relay_fanout > 0)."
    )
    relay_advertise_host: str | None = Field(
        None, description="Host other generators reach the relay at; default relay_host."
    )
    relay_wait_s: float = Field(
        180.0,
        gt=0,
        description="Longest wait for this generator's relay to hold a version before the engine "
        "fetches it from the trainer itself.",
    )
    max_jobs: int = Field(
        4,
        ge=1,
        le=64,
        description="Jobs this generator serves at once in a fleet (LoRA jobs on one base model, each its own "
        "adapter in the engine: vLLM's max_loras); a full-weight job has a generator to itself.",
    )


class RewardSettings(CommonSettings):
    model_config = SettingsConfigDict(env_prefix="REWARD_", extra="ignore", frozen=True)

    consumer_id: str = Field(default_factory=_default_worker_id, description="Consumer name; unique per replica.")
    batch: int = Field(256, ge=1, description="Rollouts read per XREADGROUP.")
    workers: int = Field(
        2,
        ge=0,
        le=256,
        description="Worker processes for sync Python rewards and the built-ins (shared.rewards.pool): a call over "
        "its time budget is killed with its worker, which is replaced. 0 runs them in threads of the service "
        "instead, where a hung call can only be abandoned, still running.",
    )
    http_max_bytes: int = Field(
        4 * 1024 * 1024,
        ge=1024,
        le=1024**3,
        description="Largest answer an HTTP scorer or judge may send, on the wire and decoded (gzip, deflate); a "
        "larger one is that batch's reward error, read no further.",
    )
    import_timeout_s: float = Field(
        60.0,
        gt=0,
        le=3600,
        description="Time to import a Python reward plug-in, done first in a child process: an import that "
        "exits, crashes or runs past it fails the job with the reason.",
    )
    metrics_port: int = Field(0, ge=0)
    max_jobs: int = Field(
        8,
        ge=1,
        le=64,
        description="Jobs this reward service scores at once in a fleet, each in a thread of its own with "
        "worker processes of its own.",
    )


class TrainerSettings(CommonSettings):
    model_config = SettingsConfigDict(env_prefix="TRAINER_", extra="ignore", frozen=True)

    consumer_id: str = Field(default_factory=_default_worker_id)
    transport: str = Field(
        "ucx", description="Weight transport: ucx (shared memory, RDMA, NVLink) or tcp (plain sockets, the fallback)."
    )
    bind_host: str = Field("127.0.0.1", description="Interface the weight server listens on.")
    bind_port: int = Field(0, ge=0, le=65535, description="Weight server port; 0 picks a free one.")
    advertise_host: str | None = Field(None, description="Host generators connect to; default bind_host.")
    keep_versions: int = Field(3, ge=1, description="Weight versions kept servable for slow generators.")
    threads: int = Field(0, ge=0, description="torch.set_num_threads; 0 leaves the default.")
    checkpoint_dir: str = Field("runs/checkpoints", description="Checkpoints go to <dir>/<job id>/step-NNNNNN.")
    device: str = Field("cpu", description="Torch device for training.")
    metrics_port: int = Field(0, ge=0)
    # NoDecode: a comma-separated string in the environment, not a JSON list
    tracking: Annotated[tuple[TrackingSink, ...], NoDecode] = Field(
        (),
        description="Metric sinks for every job this trainer runs, comma-separated (tensorboard, mlflow, wandb), "
        "besides those its spec names (tracking.sinks).",
    )
    tracking_dir: str = Field(
        "runs/tracking",
        description="Where the sinks write: <dir>/tensorboard/<project>/<job id>, <dir>/mlruns "
        "(MLflow's file store), <dir>/wandb.",
    )
    mlflow_uri: str | None = Field(
        None,
        description="MLflow tracking URI (e.g. sqlite:///mlflow.db, http://host:5000); unset: the file store "
        "<tracking_dir>/mlruns.",
    )
    wandb_mode: Literal["offline", "online"] = Field(
        "offline",
        description="W&B mode: offline writes the run under <tracking_dir>/wandb and needs no network or "
        "login (`wandb sync` uploads it later); online needs WANDB_API_KEY and the network.",
    )

    @field_validator("tracking", mode="before")
    @classmethod
    def _split_sinks(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [s.strip() for s in value.split(",") if s.strip()]
        return tuple(dict.fromkeys(value)) if isinstance(value, (list, tuple)) else value


class BrokerSettings(CommonSettings):
    model_config = SettingsConfigDict(env_prefix="BROKER_", extra="ignore", frozen=True)

    host: str = Field("127.0.0.1", description="API bind address.")
    port: int = Field(8000, ge=1, le=65535, description="API port.")
    max_body_bytes: int = Field(
        1 << 20,
        ge=1024,
        le=1 << 30,
        description="Largest request body the API reads (a job spec is a few KiB); a larger one is a 413 "
        "before any of it is parsed.",
    )
    agent_reply_timeout_s: float = Field(
        600.0,
        gt=0.0,
        le=86_400.0,
        description="How long an agent's call (/v1/chat/completions of an agent episode) waits for the generator's "
        "answer before a 504.",
    )
    metrics_max_jobs: int = Field(
        50,
        ge=0,
        le=1000,
        description="/metrics carries per-job gauges for at most this many unfinished jobs (running, "
        "paused or stopping ones first, then the newest submitted); 0 leaves them out.",
    )
    # NoDecode: the environment holds a comma-separated string, not the JSON list
    # pydantic-settings would expect.
    tokens: Annotated[tuple[str, ...], NoDecode] = Field(
        (),
        repr=False,
        description="Read-write bearer tokens, comma-separated (BROKER_TOKENS). With no token "
        "configured anywhere the API is open to anyone who can reach it.",
    )
    read_only_tokens: Annotated[tuple[str, ...], NoDecode] = Field(
        (),
        repr=False,
        description="Bearer tokens allowed only GET requests, comma-separated (BROKER_READ_ONLY_TOKENS).",
    )
    token_file: Path | None = Field(
        None,
        description="File of tokens, one per line: `TOKEN` (read-write) or `TOKEN ro` (read-only); "
        "`#` comments and blank lines are ignored (BROKER_TOKEN_FILE). Read once at start-up.",
    )

    @field_validator("tokens", "read_only_tokens", mode="before")
    @classmethod
    def _split_tokens(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = value.split(",")
        if not (isinstance(value, (list, tuple)) and all(isinstance(t, str) for t in value)):
            return value  # pydantic rejects it with its own message
        tokens = tuple(t.strip() for t in value if t.strip())
        if any(len(t.split()) != 1 for t in tokens):
            raise ValueError("a bearer token cannot contain whitespace; separate tokens with commas")
        return tokens


class AdminSettings(CommonSettings):
    """The Celery admin worker (`celery -A broker.admin worker`) and the API that submits to it."""

    model_config = SettingsConfigDict(env_prefix="ADMIN_", extra="ignore", frozen=True)

    celery_broker_url: str | None = Field(
        None, description="Celery broker; unset: REDIS_URL (admin tasks use their own keys, off the rollout streams)."
    )
    queue: str = Field("admin", description="Queue the admin tasks go to; the worker consumes only this one.")
    key_prefix: str = Field("asyncrl-admin:", description="Prefix of every Celery key in Redis.")
    export_dir: str = Field("runs/exports", description="Where exports go when the request names no folder.")
    eval_timeout_s: float = Field(1800.0, gt=0, description="A checkpoint evaluation running longer is killed.")
    eval_max_model_len: int = Field(512, ge=16, description="Context length of the evaluation engine.")
    visibility_timeout_s: float | None = Field(
        None,
        gt=0,
        description="A task a dead worker left unacked is redelivered after this long; it must exceed "
        "the longest task. Unset: ADMIN_EVAL_TIMEOUT_S + 600.",
    )

"""The common body of every `python -m <service>`: placement, settings, logging, then the heavy import.

A generator, reward or trainer process first takes its share of the node's cores and its thread
counts (`shared.placement.place_self`: the one rule the launcher uses too), before settings are
read and before torch or vLLM is imported, since they read the thread variables once.

SIGTERM is a process restart (a supervisor, systemd, `docker stop`), not the user's stop of the
job (that is `POST /jobs/{id}/stop`). Once a service's loop runs (it called `accept_drain`), the
first SIGTERM only sets a process-local drain flag: the loop finishes what it holds (a generator
its batch, the reward service its batch, the trainer its step and a checkpoint), then returns and
the process exits 0, leaving the job running for a successor. Before that, and on a second SIGTERM,
it raises `Terminated` at once. SIGINT (Ctrl-C) interrupts at once.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import threading
import time

from pydantic_settings import BaseSettings

from shared.logs import setup_logging
from shared.placement import describe, place_self

_drain = threading.Event()
_accepting = threading.Event()


class JobOver(Exception):
    """The service's job cannot or need not be served (e.g. its stored spec no longer validates,
    and the job was marked failed with the reason): `run_service` logs it and exits 0, so that no
    supervisor restarts the service into the same end."""


class Terminated(KeyboardInterrupt):
    """SIGTERM before the service could drain (or a second one): stop now; the job stays running."""


class Drained(Exception):
    """Raised by a wait that SIGTERM cut short (a generator waiting for a policy version): the
    work in hand stays unacked, pending for this consumer's successor, and the service exits as
    drained (broker/service.py ServiceLoop)."""


class JobEnded(Exception):
    """Raised by a wait inside a job's work when the job ended meanwhile (its trainer failed,
    it was cancelled): the service leaves the job, and a service of the fleet takes the next."""


def accept_drain() -> None:
    """Called by a service whose loop checks `drain_requested()`: from now on SIGTERM drains."""
    _accepting.set()


def drain_requested() -> bool:
    """Whether this process got SIGTERM and should finish its current work and exit."""
    return _drain.is_set()


def request_drain() -> None:
    """What the first SIGTERM does (tests call it directly)."""
    _drain.set()


def _on_sigterm(signum, frame):
    if _accepting.is_set() and not _drain.is_set():
        request_drain()
        logging.getLogger("shared.entry").warning("SIGTERM: finishing the current work, then exiting")
        return
    raise Terminated


def run_service(service: str, settings_cls: type[BaseSettings], target: str) -> int:
    """Parse settings from the environment, set up logging, import `module:function` and run it.

    Exit codes: 0 done, drained after SIGTERM, or the job is over (`JobOver`, logged as an
    error); 1 failed (logged with traceback); 2 bad placement variables (logged); 130 interrupted (SIGINT, or SIGTERM
    before the loop ran).
    """
    try:
        placed = place_self(target.split(".")[0])
    except ValueError as exc:  # bad NODE_* / <ROLE>_CPUS: say which, do not start misplaced
        setup_logging(service, "INFO")
        logging.getLogger(service).error("placement: %s", exc)
        return 2
    settings = settings_cls()
    setup_logging(service, getattr(settings, "log_level", "INFO"))
    signal.signal(signal.SIGTERM, _on_sigterm)
    log = logging.getLogger(service)
    if placed is not None:
        log.info("%s placed on %s", service, describe(placed, os.environ.get("NODE_PLACEMENT") or "split"))
    try:
        module, func = target.split(":")
        t0 = time.perf_counter()
        entry = getattr(importlib.import_module(module), func)
        log.info("imported %s in %.2fs", module, time.perf_counter() - t0)
        entry(settings)
    except KeyboardInterrupt:
        log.info("%s interrupted", service)
        return 130
    except JobOver as exc:
        log.error("%s: %s; nothing to serve, exiting", service, exc)
        return 0
    except Exception:
        log.exception("%s failed", service)
        return 1
    if drain_requested():
        log.info("%s drained after SIGTERM", service)
    return 0

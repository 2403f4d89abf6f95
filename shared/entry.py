"""The common body of every `python -m <service>`: settings, logging, then the heavy import."""

from __future__ import annotations

import importlib
import logging
import signal

from pydantic_settings import BaseSettings

from shared.logs import setup_logging


def _sigterm_to_keyboard_interrupt(signum, frame):  # SIGTERM stops a service like Ctrl-C does
    raise KeyboardInterrupt


def run_service(service: str, settings_cls: type[BaseSettings], target: str) -> int:
    """Parse settings from the environment, set up logging, import `module:function` and run it.

    Exit codes: 0 done, 1 failed (logged with traceback), 130 interrupted (SIGINT/SIGTERM).
    """
    settings = settings_cls()
    setup_logging(service, getattr(settings, "log_level", "INFO"))
    signal.signal(signal.SIGTERM, _sigterm_to_keyboard_interrupt)
    log = logging.getLogger(service)
    try:
        module, func = target.split(":")
        getattr(importlib.import_module(module), func)(settings)
    except KeyboardInterrupt:
        log.info("%s interrupted", service)
        return 130
    except Exception:
        log.exception("%s failed", service)
        return 1
    return 0

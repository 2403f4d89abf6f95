"""Serve the job API with uvicorn."""

from __future__ import annotations

import uvicorn

from broker.api import create_app
from shared.settings import BrokerSettings


def run(settings: BrokerSettings) -> None:
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level.lower())

"""`python -m broker`: the job API (BROKER_HOST, BROKER_PORT, REDIS_URL, DATABASE_URL)."""

import sys

from shared.entry import run_service
from shared.settings import BrokerSettings

if __name__ == "__main__":
    sys.exit(run_service("broker", BrokerSettings, "broker.serve:run"))

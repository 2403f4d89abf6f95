"""`python -m reward_svc`: the reward service, configured from the environment (see shared.settings.RewardSettings)."""

import sys

from shared.entry import run_service
from shared.settings import RewardSettings

if __name__ == "__main__":
    sys.exit(run_service("reward", RewardSettings, "reward_svc.service:run"))

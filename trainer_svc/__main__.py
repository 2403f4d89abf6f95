"""`python -m trainer_svc`: the trainer service, configured from the environment (see shared.settings.TrainerSettings)."""

import sys

from shared.entry import run_service
from shared.settings import TrainerSettings

if __name__ == "__main__":
    sys.exit(run_service("trainer", TrainerSettings, "trainer_svc.train:run"))

"""`python -m trainer_svc`: the trainer service, configured from the environment (see
shared.settings.TrainerSettings)."""

import logging
import os
import sys

from shared.entry import run_service
from shared.settings import TrainerSettings

if __name__ == "__main__":
    code = run_service("trainer", TrainerSettings, "trainer_svc.train:run")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # A rank of a torchrun group has left the process group (trainer_svc/dist.py Ranks.close)
        # or failed; either way skip interpreter finalization: gloo's worker threads may still hold
        # tensors whose release during finalization aborts the process (SIGABRT), which torchrun
        # reports as a failure of the whole trainer after a clean run.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)

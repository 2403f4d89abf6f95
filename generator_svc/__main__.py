"""`python -m generator_svc`: the generator service, configured from the environment (see
shared.settings.GeneratorSettings)."""

import sys

from shared.entry import run_service
from shared.settings import GeneratorSettings

if __name__ == "__main__":
    sys.exit(run_service("generator", GeneratorSettings, "generator_svc.service:run"))

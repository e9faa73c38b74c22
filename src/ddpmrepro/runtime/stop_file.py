"""A stop signal that came before this process could answer it.

Under SLURM, `workflow/scripts/dvc_stage.sh` runs a stage with SIGTERM ignored, so that dvc and
the launcher wait while the training saves its checkpoint; the training installs its own handler.
A SIGTERM that comes before that handler exists (dvc hashing the dependencies, Python importing
torch, the data and a checkpoint loading) is ignored, and would be lost: the training would run on
until SLURM's SIGKILL. The stage's shell catches it instead and creates the file named by
`DDPMREPRO_STOP_FILE`; a process that answers stop signals looks for the file once its handler is
in place, and stops as if it had been signalled then.
"""
from __future__ import annotations

import os

STOP_FILE = "DDPMREPRO_STOP_FILE"


def signalled_before() -> bool:
    """True when a stop signal came (and was ignored) before this process could answer it."""
    path = os.environ.get(STOP_FILE)
    return bool(path) and os.path.exists(path)

"""Moved to `ddpmrepro/respace.py` (params.py checks `sample.respacing` with it and must not import
the model). This name stays only because `training/loop.py`'s TRAIN_CODE still hashes this path
for the code version; delete it once loop.py takes `code_version` from `training/code_version.py`,
which hashes what the loop imports instead of a list of paths."""
from ..respace import ALLOWED, ddim_stride, space_timesteps

__all__ = ["space_timesteps", "ddim_stride", "ALLOWED"]

"""Dataset sources -> the prepared format (data contract, version 1), and back.

`prepare(params, out_dir)` reads any supported source (see `sources.READERS`) and writes
`train.npz`, `test.npz` (uint8 images `(N, C, H, W)`, int64 labels) and `manifest.json`,
byte-deterministically and atomically. `load_prepared(dir)` verifies and reads them.
`to_model_range` / `to_uint8` convert between uint8 images and the model's [-1, 1].
"""
from ddpmrepro.data.prepared import FORMAT_VERSION, Prepared, load_prepared, prepare, to_model_range, to_uint8
from ddpmrepro.data.sources import DataError

__all__ = ["FORMAT_VERSION", "DataError", "Prepared", "load_prepared", "prepare", "to_model_range", "to_uint8"]

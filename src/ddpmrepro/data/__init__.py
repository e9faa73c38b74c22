"""Dataset sources -> the prepared format (data contract, version 2), and back.

`prepare(params, out_dir)` reads any supported source (see `prepared.READERS`) and streams it into
fixed-size shards, `<split>-<k>.images.npy` (uint8 `(n, C, H, W)`) and `<split>-<k>.labels.npy`
(int64), plus `manifest.json`, byte-deterministically and atomically. `load_prepared(dir)` verifies
and memory-maps them (`ddpmrepro.training.batches` reads a rank's training batches from them).
`to_model_range` / `to_uint8` convert between uint8 images and the model's [-1, 1].
"""
from ddpmrepro.data.prepared import FORMAT_VERSION, Prepared, load_prepared, prepare, to_model_range, to_uint8
from ddpmrepro.data.shards import ShardedArray
from ddpmrepro.data.sources import DataError

__all__ = ["FORMAT_VERSION", "DataError", "Prepared", "ShardedArray", "load_prepared", "prepare", "to_model_range",
           "to_uint8"]

"""Training batches: DistributedSampler's order, rows read ahead from the shards in a thread, the
same numbers as a synchronous in-memory read, and a thread that always stops."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

from ddpmrepro import params as P
from ddpmrepro.training import loop as T
from ddpmrepro.data import DataError, load_prepared, prepare, shards
from ddpmrepro.training.batches import RowReader, TrainBatches, epoch_order


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """Digits in shards of 100 images: batches cross shard boundaries."""
    out = tmp_path_factory.mktemp("loader") / "p"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(shards, "SHARD_BYTES", 64 * 100)
        prepare(P.DataParams(), out)
    return out


def reader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "ddpmrepro-batches"]


@pytest.mark.parametrize("n", [10, 11, 37])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_epoch_order_is_distributed_samplers(n, world):
    for rank in range(world):
        sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=5, drop_last=True)
        for epoch in (0, 1, 7):
            sampler.set_epoch(epoch)
            assert epoch_order(n, world, rank, 5, epoch).tolist() == list(sampler)


def test_batches_read_ahead_equal_a_synchronous_in_memory_read(sharded):
    d = load_prepared(sharded)
    images = np.asarray(d.train_images)  # the whole split in memory: the reference
    batch, world = 64, 2
    per_epoch = (len(images) // world) // batch  # 11: micro 11 starts epoch 1
    for rank in range(world):
        with TrainBatches(d.train_images, batch_size=batch, world=world, rank=rank, seed=3) as batches:
            assert batches.reader.array is None and len(batches.reader.fds) == 15  # pread from the shard files
            for m in [0, 1, 2, 10, 11, 12, 5, 6, 30]:  # a jump back and forth restarts the read-ahead
                idx, rows = batches.get(m)
                sampler = DistributedSampler(range(len(images)), world, rank, shuffle=True, seed=3, drop_last=True)
                sampler.set_epoch(m // per_epoch)
                pos = m % per_epoch
                assert idx.tolist() == list(sampler)[pos * batch:(pos + 1) * batch]
                assert rows.dtype == torch.uint8 and torch.equal(rows, torch.from_numpy(images[idx.numpy()]))
        assert reader_threads() == []


def test_an_in_memory_array_is_read_by_indexing(sharded):
    images = np.asarray(load_prepared(sharded).train_images)
    reader = RowReader(images)
    out = np.empty((3, *images.shape[1:]), np.uint8)
    reader.gather(np.array([7, 0, 1437]), out)
    assert reader.array is images and np.array_equal(out, images[[7, 0, 1437]])


@pytest.mark.parametrize("exit_with", [None, ValueError, SystemExit])
def test_the_thread_stops_at_the_end_on_errors_and_on_sigterms_exit(sharded, exit_with):
    """SIGTERM in training becomes SystemExit(130) at a step boundary: the reader must not outlive it."""
    d = load_prepared(sharded)
    with pytest.raises(exit_with) if exit_with else torch.no_grad():
        with TrainBatches(d.train_images, batch_size=16, world=1, rank=0, seed=0) as batches:
            batches.get(0)
            assert len(reader_threads()) == 1
            if exit_with:
                raise exit_with(130)
    assert reader_threads() == [] and batches.reader.fds == []


def test_a_shard_damaged_after_verification_fails_in_one_line(sharded, tmp_path):
    import shutil

    shutil.copytree(sharded, tmp_path / "p")
    d = load_prepared(tmp_path / "p")
    with open(tmp_path / "p" / "train-00003.images.npy", "r+b") as f:
        f.truncate(200)
    with TrainBatches(d.train_images, batch_size=512, world=1, rank=0, seed=0) as batches:
        with pytest.raises(DataError, match=r"train-00003\.images\.npy: ends before row \d+; the file changed"):
            batches.get(0)
    assert reader_threads() == []


class InMemoryBatches:
    """What training did before format 2: DistributedSampler's list and `images[idx]` on a tensor, and
    the examples' draws, synchronously."""

    def __init__(self, images, *, batch_size, world, rank, seed, device=None, prepare=None):
        self.prepare = prepare  # the examples' draws, made here in the training thread
        self.images = torch.as_tensor(np.asarray(images))
        self.sampler = DistributedSampler(range(len(images)), world, rank, shuffle=True, seed=seed, drop_last=True)
        self.batch_size = batch_size

    def get(self, micro):
        epoch, pos = divmod(micro, len(self.sampler) // self.batch_size)
        self.sampler.set_epoch(epoch)
        idx = torch.tensor(list(self.sampler)[pos * self.batch_size:(pos + 1) * self.batch_size])
        return (idx, self.images[idx]) if self.prepare is None else self.prepare(micro, idx, self.images[idx])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


def test_training_on_shards_read_ahead_gives_the_in_memory_weights_bitwise(sharded, tmp_path, monkeypatch, one_thread):
    params = P.from_dict({
        "model": {"channels": 16, "channel_mult": [1, 2], "num_res_blocks": 1, "attention_resolutions": [4],
                  "num_head_channels": 16},
        "diffusion": {"timesteps": 10},
        "train": {"steps": 12, "batch_per_proc": 128, "warmup_steps": 0, "checkpoint_every": 12, "log_every": 4,
                  "ema_rates": [0.9], "label_dropout": 0.2},  # 12 steps of 128: into the second epoch
        "introspect": {"every": 0, "steps": []},
        "sample": {"respacing": "ddim5"},  # the default ddim50 cannot respace 10 timesteps
    })
    weights = {}
    for name in ("shards", "memory"):
        if name == "memory":
            monkeypatch.setattr(T, "TrainBatches", InMemoryBatches)
        run = tmp_path / name
        T.train(params, T.TrainPaths(sharded, run / "model", run / "live", run / "introspect", run / "ckpt"))
        weights[name] = (run / "model" / "model.safetensors").read_bytes()
    assert weights["shards"] == weights["memory"]
    assert reader_threads() == []


def test_only_whole_file_maps_are_read_with_pread(sharded):
    """A slice of a map keeps the parent's offset: reading it by offset would return the wrong rows."""
    d = load_prepared(sharded)
    part = d.train_images.parts[2]
    assert shards.row_sources(part) == [(part.filename, part.offset, 100)]
    assert shards.row_sources(part[10:]) is None and shards.row_sources(np.asarray(part)) is None
    reader = RowReader(part[10:])
    out = np.empty((2, 1, 8, 8), np.uint8)
    reader.gather(np.array([0, 5]), out)
    assert np.array_equal(out, np.asarray(part)[[10, 15]])


def test_training_makes_every_draw_on_the_reader_thread(sharded, tmp_path, monkeypatch, one_thread):
    """The main thread calls no per-example generator: it takes t from the sampler and launches the
    step (issue 38: no host work on the step's critical path)."""
    from ddpmrepro.training import batches as B

    threads = []
    original = B.example_draws

    def recording(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return original(*args, **kwargs)

    monkeypatch.setattr(B, "example_draws", recording)
    params = P.from_dict({
        "model": {"channels": 8, "channel_mult": [1], "num_res_blocks": 1, "attention_resolutions": [],
                  "num_head_channels": 8},
        "diffusion": {"timesteps": 10}, "sample": {"respacing": "ddim5"},
        "train": {"steps": 3, "batch_per_proc": 16, "grad_accum": 2, "warmup_steps": 0, "ema_rates": [0.9]},
        "introspect": {"every": 0, "steps": []}})
    run = tmp_path / "run"
    T.train(params, T.TrainPaths(sharded, run / "model", run / "live", run / "introspect", run / "ckpt"))
    assert len(threads) >= 6 and set(threads) == {"ddpmrepro-batches"}, threads

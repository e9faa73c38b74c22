"""A rank's training batches: which examples, in which order, read ahead while the model computes,
and each example's own random draws (timestep, noise, label dropout, flip).

Reproducibility: the data order is a function of (seed, epoch), and each example's draws come from
its own generator seeded by (seed, microbatch, position of the example in the global batch). So a
resumed run draws exactly the numbers an uninterrupted run would have drawn (the checkpoint only
needs the step), and 2 processes x batch B see exactly the examples and draws of 1 process x 2B.

The order is a function of (seed, epoch) only, the one `torch.utils.data.DistributedSampler`
(shuffle, drop_last) gives: rank r takes positions r, r + W, r + 2W, ... of a seeded permutation.
So exact resume and "2 processes x B = 1 process x 2B" do not depend on how rows are read.

Rows are read with `pread` from the shard files, not through the memory map: a rank's resident
memory then stays flat for the whole run (touched pages of a map count in its RSS until unmapped,
which over an epoch means the whole dataset), the kernel's page cache still serves repeated reads,
and no readahead is wasted on random rows. A background thread reads the next microbatches (two
ahead) while the current one computes, into pinned memory when training on a GPU (the copy to the
device can then overlap). The same thread makes each example's own draws (`TrainExamples.draws`:
label dropout, flip, the uniform behind its timestep, its noise, an upsampler's low-res input):
none depends on the training's state, so they are the numbers a synchronous draw gives, and the
main thread is left only t = sampler(u), which must follow the previous step's sampler update, and
the launch of the step. Images go to the device as uint8 and become floats there (a quarter of
the bytes to copy).
"""
from __future__ import annotations

import os
import queue
import threading
from dataclasses import dataclass

import numpy as np
import torch

from ..data import shards, to_model_range
from ..data.sources import DataError
from ..model.superres import augment, low_res_input


def epoch_order(n: int, world: int, rank: int, seed: int, epoch: int) -> torch.Tensor:
    """This rank's example indices for `epoch`: exactly `list(DistributedSampler(range(n), world, rank,
    shuffle=True, seed=seed, drop_last=True))` after `set_epoch(epoch)`, as an int64 tensor (a Python
    list of 1M ints would cost ~40 MB per rank)."""
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    total = (n // world) * world
    return torch.randperm(n, generator=g)[:total][rank:total:world]


class RowReader:
    """Gathers rows of a prepared image array: pread from its shard files when it is memory-mapped
    (what `load_prepared` returns), plain indexing when it is an in-memory array."""

    def __init__(self, images):
        self.row_shape, self.dtype = tuple(images.shape[1:]), np.dtype(images.dtype)
        self.row_bytes = int(np.prod(self.row_shape)) * self.dtype.itemsize
        sources = shards.row_sources(images)
        self.array = images if sources is None else None
        self.files = [] if sources is None else [name for name, _, _ in sources]
        self.fds = [os.open(name, os.O_RDONLY) for name in self.files]
        self.offsets = np.array([offset for _, offset, _ in sources or []], np.int64)
        self.starts = np.cumsum([0] + [rows for _, _, rows in sources or []])

    def gather(self, idx: np.ndarray, out: np.ndarray) -> None:
        """out[i] = images[idx[i]]; rows are read in file order (kind to disks and network file systems)."""
        if self.array is not None:
            out[...] = self.array[idx]
            return
        shard = np.searchsorted(self.starts, idx, side="right") - 1
        pos = self.offsets[shard] + (idx - self.starts[shard]) * self.row_bytes
        flat = out.reshape(len(idx), -1).view(np.uint8)
        for i in np.lexsort((pos, shard)):
            k = int(shard[i])
            got = os.preadv(self.fds[k], [flat[i]], int(pos[i]))
            if got != self.row_bytes:
                raise DataError(f"{self.files[k]}: ends before row {int(idx[i] - self.starts[k])}; the file changed "
                                "after it was verified, run `ddpmrepro prepare` again")

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


class TrainBatches:
    """`get(m)` -> (indices, uint8 images (B, C, H, W)) of this rank's microbatch m, m = 0, 1, 2, ...,
    or what `prepare(m, indices, images)` makes of them; a background thread reads (and prepares)
    m + 1 and m + 2 meanwhile. Use as a context manager (or call `close`): the thread stops on exit,
    on errors and on SIGTERM's SystemExit alike."""

    DEPTH = 2

    def __init__(self, images, *, batch_size: int, world: int, rank: int, seed: int,
                 device: torch.device | None = None, prepare=None):
        self.prepare = prepare
        self.n, self.batch_size, self.world, self.rank, self.seed = len(images), batch_size, world, rank, seed
        self.batches_per_epoch = (self.n // world) // batch_size
        if self.batches_per_epoch == 0:
            raise ValueError(f"batch size {batch_size} is larger than this rank's {self.n // world} examples")
        self.pin = device is not None and device.type == "cuda"
        self.device = device
        self.reader = RowReader(images)
        self._order: tuple[int, torch.Tensor] | None = None
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue = queue.Queue(self.DEPTH)
        self._stop = threading.Event()
        self._next = None

    def indices(self, micro: int) -> torch.Tensor:
        epoch, pos = divmod(micro, self.batches_per_epoch)
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, epoch_order(self.n, self.world, self.rank, self.seed, epoch))
        return self._order[1][pos * self.batch_size:(pos + 1) * self.batch_size]

    def read(self, micro: int):
        """Microbatch `micro`, read (and prepared) now in the calling thread."""
        idx = self.indices(micro)
        rows = torch.empty((len(idx), *self.reader.row_shape), dtype=torch.uint8, pin_memory=self.pin)
        self.reader.gather(idx.numpy(), rows.numpy())
        return (idx, rows) if self.prepare is None else self.prepare(micro, idx, rows)

    def get(self, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._thread is None or self._next != micro:  # first call, or a jump: read ahead from here
            self._stop_thread()
            self._stop.clear()
            self._thread = threading.Thread(target=self._read_ahead, args=(micro,), name="ddpmrepro-batches",
                                            daemon=True)
            self._thread.start()
        while True:
            try:
                item = self._queue.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._thread.is_alive():
                    raise RuntimeError("the batch reader thread stopped without a result") from None
        if isinstance(item, BaseException):
            self._thread = None
            raise item
        self._next = micro + 1
        return item

    def _read_ahead(self, micro: int) -> None:
        try:
            if self.pin:  # pinned memory is allocated on the current device, which is per thread
                torch.cuda.set_device(self.device)
            while not self._stop.is_set():
                self._put(self.read(micro))
                micro += 1
        except BaseException as e:  # handed to the training thread, raised by its next get()
            self._put(e)

    def _put(self, item) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def _stop_thread(self) -> None:
        if self._thread is not None:
            self._stop.set()
            while self._thread.is_alive():
                try:  # unblock a put waiting for room
                    self._queue.get(timeout=0.05)
                except queue.Empty:
                    pass
            self._thread.join()
            self._thread = None
        while not self._queue.empty():
            self._queue.get_nowait()

    def close(self) -> None:
        self._stop_thread()
        self.reader.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# --- each example's random draws ---------------------------------------------------------------


def step_seed(seed: int, step: int, rank: int, stream: int = 0) -> int:
    """A distinct 63-bit seed per (seed, step, rank, stream)."""
    x = (seed * 1_000_003 + step) * 65_537 + rank * 257 + stream
    return (x * 0x9E3779B97F4A7C15) % (2**63 - 1)


def example_draws(seeds: list[int], shape, low_res_shape=None) -> tuple[torch.Tensor, ...]:
    """Each example's own draws from a generator seeded by its seed: u (B, 3) float64 uniforms
    (label drop, flip, timestep), then noise (B, *shape) float32 standard normals.

    One generator is reseeded per example (`manual_seed` resets its whole state, the cached normal
    sample included, so this draws exactly what a fresh generator per example draws), and the draws
    fill the rows of the batch tensors in place (`torch.rand`/`randn` are `uniform_`/`normal_` on
    a new tensor): 128 fresh generators and row copies took ~3 ms of Python and dispatch per step,
    this ~1.2 ms; serial work, which more threads do not shorten.

    With `low_res_shape` (a super-resolution model) each example then draws one more uniform (its
    augmentation level) and that noise image, after the others: a base model's draws are unchanged.
    """
    u = torch.empty(len(seeds), 3, dtype=torch.float64)
    noise = torch.empty(len(seeds), *shape)
    if low_res_shape is not None:
        u_aug = torch.empty(len(seeds), dtype=torch.float64)
        noise_aug = torch.empty(len(seeds), *low_res_shape)
    g = torch.Generator()
    for i, (seed, u_i, noise_i) in enumerate(zip(seeds, u, noise)):
        g.manual_seed(seed)
        u_i.uniform_(generator=g)
        noise_i.normal_(generator=g)
        if low_res_shape is not None:
            u_aug[i:i + 1].uniform_(generator=g)
            noise_aug[i].normal_(generator=g)
    return (u, noise) if low_res_shape is None else (u, noise, u_aug, noise_aug)


def timestep_uniforms(seed: int, global_micro: int, global_batch: int) -> torch.Tensor:
    """The uniforms behind the timesteps (global_batch,) float64 of global microbatch `global_micro`,
    as `TrainExamples.draws` draws them (example i of the global batch from `step_seed(seed, m, i, 1)`),
    with noise of no pixels: a replay of a run's timestep draws (`timestep_sampler.steering_step`)."""
    seeds = [step_seed(seed, global_micro, i, 1) for i in range(global_batch)]
    return example_draws(seeds, (0,))[0][:, 2].contiguous()


@dataclass
class Draws:
    """A microbatch's examples with their own draws, everything that does not depend on the training's
    state (made on the read-ahead thread): uint8 images (B, C, H, W) and which to flip, labels (the
    null class where dropped), the uniforms behind the timesteps, noise, and an upsampler's inputs.
    In pinned memory when training on a GPU, so the copies to the device do not wait for the host."""

    rows: torch.Tensor
    flip: torch.Tensor | None
    y: torch.Tensor
    u_t: torch.Tensor
    noise: torch.Tensor
    cond: dict


@dataclass
class Microbatch:
    """What one forward/backward pass trains on, on the host until `to(device)`: uint8 images
    (B, C, H, W) and which to flip, labels (the null class where dropped), timesteps with their
    importance weights, noise, and the model's extra inputs (an upsampler's low-resolution image and
    its augmentation level). `x0`, the images in [-1, 1], is made on the device by `to`."""

    rows: torch.Tensor
    flip: torch.Tensor | None
    y: torch.Tensor
    t: torch.Tensor
    weights: torch.Tensor
    noise: torch.Tensor
    cond: dict
    x0: torch.Tensor | None = None

    def to(self, device: torch.device, layout: torch.memory_format = torch.contiguous_format) -> "Microbatch":
        """On `device`, `x0` made there from the uint8 rows (the same float32 values as on the host);
        the images (`x0`, the noise, an upsampler's low-res input) in `layout` (train.channels_last)."""
        tensors = {"rows": self.rows, "y": self.y, "t": self.t, "weights": self.weights, "noise": self.noise,
                   **({"flip": self.flip} if self.flip is not None else {}), **self.cond}
        if device.type == "cuda":  # pinned host memory: the copies do not block the host (most are pinned already)
            tensors = {k: v if v.is_pinned() else v.pin_memory() for k, v in tensors.items()}
        moved = {k: v.to(device, non_blocking=True) for k, v in tensors.items()}
        if layout != torch.contiguous_format:  # the same values, strided as the weights are (the rows as uint8: 4x fewer bytes)
            moved = {k: v.contiguous(memory_format=layout) if v.dim() == 4 else v for k, v in moved.items()}
        rows, flip = moved.pop("rows"), moved.pop("flip", None)
        x0 = images_in_model_range(rows, flip)  # elementwise: in the rows' layout
        return Microbatch(rows, flip, *(moved.pop(k) for k in ("y", "t", "weights", "noise")), cond=moved, x0=x0)


def images_in_model_range(rows: torch.Tensor, flip: torch.Tensor | None) -> torch.Tensor:
    """uint8 images (B, C, H, W) as floats in [-1, 1], those of `flip` (B,) mirrored left to right."""
    x0 = to_model_range(rows)
    return x0 if flip is None else torch.where(flip[:, None, None, None], x0.flip(-1), x0)


class TrainExamples:
    """This rank's examples of global microbatch m with their own draws: `draws(m, indices, images)`
    (everything independent of the training's state: `TrainBatches` calls it on its read-ahead thread),
    then `microbatch(draws, sampler)`, the timesteps drawn from the sampler as it stands.

    Rank r holds the examples r, r + W, r + 2W, ... of the global batch (DistributedSampler's
    order), and example i of the global batch draws from `step_seed(seed, m, i, 1)`.
    """

    def __init__(self, labels: torch.Tensor, *, seed: int, rank: int, world: int, num_classes: int,
                 label_dropout: float, hflip: bool, superres, pin: bool = False):
        self.labels, self.seed, self.rank, self.world = labels, seed, rank, world
        self.num_classes, self.label_dropout, self.hflip, self.superres = num_classes, label_dropout, hflip, superres
        self.pin = pin

    def draws(self, global_micro: int, idx: torch.Tensor, rows: torch.Tensor) -> Draws:
        seeds = [step_seed(self.seed, global_micro, self.rank + self.world * i, 1) for i in range(len(idx))]
        sr = self.superres
        low_shape = (rows.shape[1], sr.low_res, sr.low_res) if sr.low_res else None
        u, noise, *aug = example_draws(seeds, rows.shape[1:], low_shape)
        flip = u[:, 1] < 0.5 if self.hflip else None
        y = self.labels[idx]
        # Classifier-free guidance: replace some labels by the null class.
        y = torch.where(u[:, 0] < self.label_dropout, torch.full_like(y, self.num_classes), y)
        cond = {}
        if sr.low_res:  # the upsampler's input: this image downsampled (as sampling sees it), then noised
            cond["low_res"] = low_res_input(images_in_model_range(rows, flip), sr.low_res, sr.quantise)
            if sr.noise_aug:
                level = (aug[0] * sr.noise_aug).float()
                cond = {"low_res": augment(cond["low_res"], level, aug[1]), "aug_level": level}
        if self.pin:  # pinned here, off the main thread (rows come pinned from the reader)
            y, noise, flip = y.pin_memory(), noise.pin_memory(), flip.pin_memory() if flip is not None else None
            cond = {k: v.pin_memory() for k, v in cond.items()}
        return Draws(rows, flip, y, u[:, 2].contiguous(), noise, cond)

    def microbatch(self, draws: Draws, sampler) -> Microbatch:
        """The microbatch of `draws` with its timesteps and importance weights from `sampler` as it is
        now (after the previous step's update)."""
        t, weights = sampler.sample_from_uniform(draws.u_t)
        if self.pin:
            t, weights = t.pin_memory(), weights.pin_memory()
        return Microbatch(draws.rows, draws.flip, draws.y, t, weights, draws.noise, draws.cond)

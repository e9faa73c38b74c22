"""The training loop: one function, top to bottom, one comment per phase.

This is the only module that knows about DDP, autocast, the GradScaler, EMA, the timestep
sampler and introspection. The UNet and the diffusion math stay pure.

Reproducibility: the data order is a function of (seed, epoch), and each example's random
draws (timestep, noise, label dropout, flip) come from its own generator seeded by (seed,
microbatch, position of the example in the global batch). So a resumed run draws exactly the
numbers an uninterrupted run would have drawn (the checkpoint only needs the step), and
2 processes x batch B see exactly the examples and draws of 1 process x batch 2B. Dropout
masks come from the global RNG, reseeded per (seed, step, rank).
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from .. import files
from ..data import load_prepared, to_model_range
from ..model.diffusion import from_params as diffusion_from_params
from ..model.superres import augment, build_superres, low_res_input
from ..model.unet import build_unet
from ..params import Params, ParamsError
from ..runtime import distributed as D
from . import checkpoint as ckpt
from . import introspect
from .batches import TrainBatches
from .ema import EmaUpdater, ema_decay, init_ema
from .timestep_sampler import PendingUpdate, create_sampler

log = logging.getLogger("ddpmrepro.training.loop")

# Keys that change how often we log or save, or how failures are handled, not what is learned:
# they must not invalidate a checkpoint or the run hash. (`on_nonfinite: error` saves nothing
# after a non-finite step, so a run stopped by it resumes under `skip` exactly as a `skip` run.)
OPERATIONAL_TRAIN_KEYS = ("checkpoint_every", "keep_checkpoints", "log_every", "on_nonfinite", "max_restarts")


# The superres keys that change what an upsampler learns (the others are read by sampling only).
SUPERRES_TRAIN_KEYS = ("low_res", "quantise", "noise_aug")


# What a checkpoint must hold to be resumed (a file with a valid sidecar can still be something else).
CHECKPOINT_KEYS = {"step", "model", "optimizer", "scaler", "ema", "sampler", "ema_updates", "skipped_steps",
                   "log_sums", "run_hash", "code_version"}


@dataclass(frozen=True)
class TrainPaths:
    data_dir: Path
    model_dir: Path
    live_dir: Path
    introspect_dir: Path
    checkpoint_root: Path


# The code that trains, relative to the package: exactly the train stage's code deps in dvc.yaml
# (a test keeps the two equal, and equal to what the stage imports). model/ file by file: training
# does not import the samplers, so a change to them must not stop a checkpoint from resuming (the
# files are hashed in the order model/'s rglob gave them).
TRAIN_CODE = ("__init__.py", "cli.py", "files.py", "model_dir.py", "params.py", "data", "interop", "model/__init__.py",
              "model/diffusion.py", "model/respace.py", "model/superres.py", "model/unet.py", "runtime", "training")


def code_version() -> str:
    """sha256 over TRAIN_CODE's sources: a checkpoint resumes only under the same code."""
    import hashlib

    root = Path(__file__).resolve().parents[1]  # src/ddpmrepro
    h = hashlib.sha256()
    for name in TRAIN_CODE:
        files = sorted((root / name).rglob("*.py")) if (root / name).is_dir() else [root / name]
        for f in files:
            h.update(f.relative_to(root).as_posix().encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def run_hash(params: Params, data_digest: str) -> str:
    """Identifies what a checkpoint was trained with (the run's checkpoint directory)."""
    import hashlib

    d = params.to_dict()
    train = {k: v for k, v in d["train"].items() if k not in OPERATIONAL_TRAIN_KEYS}
    # Checkpointing changes memory, not one bit of the updates: a run may resume with it switched.
    model = {k: v for k, v in d["model"].items() if k != "grad_checkpoint"}
    what = {"data": data_digest, "model": model, "diffusion": d["diffusion"], "train": train}
    if params.superres.low_res:  # an upsampler: what it is trained on (a base run's hash is as before)
        what["superres"] = {k: d["superres"][k] for k in SUPERRES_TRAIN_KEYS}
    blob = json.dumps(what, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


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


def lr_at(step: int, p) -> float:
    """Linear warmup to lr, then constant or a linear anneal to 0 at the last step."""
    lr = p.lr
    if p.warmup_steps and step < p.warmup_steps:
        return lr * (step + 1) / p.warmup_steps
    if p.anneal == "linear":
        span = max(1, p.steps - p.warmup_steps)
        return lr * max(0.0, 1.0 - (step - p.warmup_steps) / span)
    return lr


def resolve_device(requested: str) -> torch.device:
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("train.device is 'cuda' but no CUDA device is visible; set train.device: cpu or auto")
    return torch.device("cuda", D.local_rank())


class StopRequest:
    """SIGINT/SIGTERM ask for a checkpoint at the next step boundary; a second SIGINT exits at once."""

    def __init__(self):
        self.requested = False
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt  # second Ctrl-C: leave now; checkpoints are atomic, nothing is corrupted
        self.requested = True
        print(f"\n{signal.Signals(signum).name} received: saving a checkpoint at the end of this step "
              "(Ctrl-C again to exit at once)", file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def _truncate_live_history(live_dir: Path, start_step: int) -> None:
    """Drops dvclive rows logged after the checkpoint we resume from, so no step appears twice.
    (Rows are keyed by the number of steps completed, so `start_step` itself is kept.)"""
    for tsv in (live_dir / "plots" / "metrics").rglob("*.tsv"):
        lines = tsv.read_text().splitlines()
        if not lines:
            continue
        header, rows = lines[0], lines[1:]
        fields = header.split("\t")
        if "step" not in fields:  # a kill tore the file's first write: it holds no complete row
            tsv.unlink()
            continue
        col = fields.index("step")
        # A kill mid-append can leave a torn last row: keep only whole rows.
        kept = [r for r in rows if len(r.split("\t")) == len(fields) and r.split("\t")[col].isdigit()
                and int(r.split("\t")[col]) <= start_step]
        tsv.write_text("\n".join([header, *kept]) + "\n")


def train(params: Params, paths: TrainPaths, *, restart: bool = False) -> dict:
    """Trains the diffusion model described by `params`; returns the final summary (rank 0)."""
    p = params.train
    device = resolve_device(p.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    D.init(device.type)
    rank, world = D.rank(), D.world_size()
    main = D.is_main()

    # Data: every shard verified against the manifest; images stay on disk (read row by row), labels in memory.
    data = load_prepared(paths.data_dir)
    manifest = data.manifest
    labels = torch.as_tensor(data.train_labels, dtype=torch.long)
    num_classes = manifest["num_classes"]
    hflip = bool(manifest.get("hflip_ok", False))
    # Refused here, before anything is written. The data order (drop_last) gives each rank N // W.
    if len(labels) // world < p.batch_per_proc:
        raise ParamsError(f"train.batch_per_proc={p.batch_per_proc} is larger than this rank's "
                          f"{len(labels) // world} training images; lower it")

    # Model, diffusion, optimizer, EMA, timestep sampler.
    torch.manual_seed(p.seed)  # identical initial weights on every rank
    diffusion = diffusion_from_params(params.diffusion)
    sr = params.superres
    shape = dict(image_size=manifest["image_size"], in_channels=manifest["channels"], num_classes=num_classes,
                 learn_sigma=params.diffusion.variance == "learned_range")
    raw_model = (build_superres(params.model, sr, **shape) if sr.low_res else build_unet(params.model, **shape)).to(device)
    # One fused kernel per step on GPUs; the multi-tensor (foreach) path elsewhere.
    opt = torch.optim.AdamW(raw_model.parameters(), lr=p.lr, weight_decay=p.weight_decay,
                            **({"fused": True} if device.type == "cuda" else {"foreach": True}))
    scaler = torch.amp.GradScaler(device.type, enabled=p.precision == "fp16")
    autocast_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(p.precision)
    emas = {rate: init_ema(raw_model) for rate in p.ema_rates}
    sampler = create_sampler(p.timestep_sampler, diffusion.num_timesteps)
    ema_updates, skipped_steps, start_step, log_sums = 0, 0, 0, None
    last_summary: dict = {}  # the last logged values: exported with the model, kept by a rerun that has no step left

    # Gradient recorders: their patterns are checked against this model here, before anything is written.
    try:
        grad_rec = introspect.ParamGradRecorder(raw_model.named_parameters(), params.introspect.params,
                                                update_ratio=params.introspect.update_ratio)
    except ValueError as e:
        raise ParamsError(f"introspect.params: {e}") from None
    try:
        act_rec = introspect.ActivationGradRecorder(
            raw_model, params.introspect.modules, histogram_bins=params.introspect.histogram_bins,
            dump_steps=params.introspect.dump_steps, dump_modules=params.introspect.dump_modules,
            dump_max_mb=params.introspect.dump_max_mb, reduction="global")
    except ValueError as e:
        raise ParamsError(f"introspect.modules: {e}") from None

    # Resume from the newest checkpoint of this exact run: checkpoints/<params+data>/<code>/.
    # Other code never touches that directory, so no finished checkpoint is ever overwritten.
    run_id = run_hash(params, manifest["splits"]["train"]["sha256"])
    version = code_version()
    ckpt_dir = paths.checkpoint_root / run_id / version
    if not restart:
        _refuse_interrupted_run_of_other_code(ckpt_dir, p.steps)
    lock = ckpt.RunLock(ckpt_dir) if main else contextlib.nullcontext()
    with lock:
        if main:
            ckpt.remove_stale_temp_files(ckpt_dir)  # of writers killed mid-write (we hold the lock now)
        # After a rank failure, `torchrun --max-restarts` relaunches the same command: resume from
        # the checkpoints this run wrote even if the first launch said --restart.
        relaunched = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
        latest = None if restart and not relaunched else ckpt.latest_checkpoint(ckpt_dir)
        if latest is not None:
            state = ckpt.load_checkpoint(latest)
            if not isinstance(state, dict) or not CHECKPOINT_KEYS <= state.keys():
                raise files.CheckpointError(f"{latest}: not a training checkpoint of ddpmrepro; delete it to resume "
                                           "from an earlier checkpoint")
            if state["code_version"] != version:
                raise files.CheckpointError(
                    f"{latest}: written by code version {state['code_version']}, this is {version}; "
                    "rerun with `ddpmrepro train --restart` to start over, or restore that code")
            if state["run_hash"] != run_id:
                raise files.CheckpointError(f"{latest}: belongs to run {state['run_hash']}, not {run_id}; remove it")
            raw_model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            scaler.load_state_dict(state["scaler"])
            emas = {float(r): v for r, v in state["ema"].items()}
            sampler.load_state_dict(state["sampler"])
            # No RNG state to restore: every draw of step s comes from seeds of (seed, s, rank).
            start_step, ema_updates, skipped_steps = state["step"], state["ema_updates"], state["skipped_steps"]
            # This rank's running sums of the log window in progress (a resume under another --nproc:
            # rank 0 carries all of them; the data order differs then anyway).
            sums = state["log_sums"]
            log_sums = sums[rank] if len(sums) == world else sums.sum(0) * (rank == 0)
            last_summary = state.get("summary", {})  # absent before 2026-11-23; other code versions are refused above
            if main:
                log.info("resuming from %s (step %d)", latest, start_step)
        model = DDP(raw_model, device_ids=[device.index] if device.type == "cuda" else None) if world > 1 else raw_model
        ema_updaters = {rate: EmaUpdater(ema, raw_model) for rate, ema in emas.items()}
        # Sampler updates whose losses are still being copied to the host: applied just before the
        # next draw (and before a checkpoint), so the GPU is never waited for inside a step.
        pending_updates: list[PendingUpdate] = []

        def apply_pending_updates():
            while pending_updates:
                pending_updates.pop(0).apply_to(sampler)

        # Data order: a per-epoch permutation of (seed, epoch) sharded over ranks (DistributedSampler's),
        # rows read ahead in a background thread.
        batches = TrainBatches(data.train_images, batch_size=p.batch_per_proc, world=world, rank=rank, seed=p.seed,
                               device=device)

        def microbatch(global_micro: int):
            """This rank's examples of a microbatch and their own random draws."""
            idx, rows = batches.get(global_micro)
            x0 = to_model_range(rows)  # (B, C, H, W) in [-1, 1]
            # DistributedSampler gives rank r the examples r, r + W, r + 2W, ... of the global batch.
            seeds = [step_seed(p.seed, global_micro, rank + world * i, 1) for i in range(len(idx))]
            low_shape = (x0.shape[1], sr.low_res, sr.low_res) if sr.low_res else None
            u, noise, *aug = example_draws(seeds, x0.shape[1:], low_shape)
            if hflip:
                x0 = torch.where((u[:, 1] < 0.5)[:, None, None, None], x0.flip(-1), x0)
            y = labels[idx]
            # Classifier-free guidance: replace some labels by the null class.
            y = torch.where(u[:, 0] < p.label_dropout, torch.full_like(y, num_classes), y)
            apply_pending_updates()
            t, weights = sampler.sample_from_uniform(u[:, 2])
            cond = {}
            if sr.low_res:  # the upsampler's input: this image downsampled (as sampling sees it), then noised
                cond["low_res"] = low_res_input(x0, sr.low_res, sr.quantise)
                if sr.noise_aug:
                    level = (aug[0] * sr.noise_aug).float()
                    cond = {"low_res": augment(cond["low_res"], level, aug[1]), "aug_level": level}
            return x0, y, t, weights, noise, cond

        # Introspection and logging live on rank 0 (activation stats are reduced over ranks).
        # Tables and curves are written into the run directory while training (DVC deletes a
        # stage's outputs before rerunning it, so a resumed run would lose the rows written before
        # the kill); the export at the end copies them to the DVC outputs.
        live = writer = None
        work_live, work_tables = ckpt_dir / "live", ckpt_dir / "introspect"
        if main:
            from dvclive import Live

            work_live.mkdir(parents=True, exist_ok=True)
            if start_step:
                _truncate_live_history(work_live, start_step)
            live = Live(dir=str(work_live), dvcyaml=False, save_dvc_exp=False, resume=start_step > 0)
            writer = introspect.TableWriter(work_tables, start_step=start_step)

        # Running sums for the log line, kept on the device (no host sync between log steps).
        stats = torch.zeros(4, dtype=torch.float64, device=device)  # sums of loss, mse, vb; count
        quart = torch.zeros(2, 4, dtype=torch.float64, device=device)  # loss sum, count per t quartile
        if log_sums is not None:  # a resumed window averages the same steps as an uninterrupted one
            stats.copy_(log_sums[:4])
            quart.copy_(log_sums[4:].view(2, 4))
        first_nonfinite = torch.zeros((), dtype=torch.long, device=device)  # first step with a NaN/inf grad norm; 0: none
        saved_step = start_step
        t_last, imgs_since = time.perf_counter(), 0
        progress = _progress(main, start_step, p.steps)
        summary: dict = last_summary

        ip = params.introspect
        with StopRequest() as stop, act_rec, batches:
            for step in range(start_step, p.steps):
                done = step + 1  # updates completed after this one: the step number of logs, tables, checkpoints
                # Dropout masks of this step come from (seed, step, rank).
                torch.manual_seed(step_seed(p.seed, step, rank, 0))
                for group in opt.param_groups:
                    group["lr"] = lr_at(step, p)
                recording = introspect.is_record_step(done, ip.every, [*ip.steps, *ip.dump_steps], last=p.steps)
                loss_scale = scaler.get_scale() if scaler.is_enabled() else 1.0
                if recording:
                    act_rec.arm(done, loss_scale=loss_scale)

                # Accumulate gradients over microbatches; only the last one all-reduces.
                for micro in range(p.grad_accum):
                    x0, y, t, weights, noise, cond = microbatch(step * p.grad_accum + micro)
                    if device.type == "cuda":  # pinned host memory: the copies do not block the host
                        x0, y, t, weights, noise = (v.pin_memory() for v in (x0, y, t, weights, noise))
                        cond = {k: v.pin_memory() for k, v in cond.items()}
                    x0, y, t, weights, noise = (v.to(device, non_blocking=True) for v in (x0, y, t, weights, noise))
                    cond = {k: v.to(device, non_blocking=True) for k, v in cond.items()}

                    def model_fn(x, tt, y=y if params.model.class_cond else None, cond=cond):  # None: unconditional
                        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                            out = model(x, tt, y, **cond)
                        return out.float()  # diffusion math runs in fp32, outside autocast

                    sync = contextlib.nullcontext() if (micro == p.grad_accum - 1 or world == 1) else model.no_sync()
                    with sync:
                        losses = diffusion.training_losses(model_fn, x0, t, noise=noise)
                        if p.timestep_sampler != "uniform":  # queued now, applied before the next draw
                            pending_updates.append(PendingUpdate(t, losses["loss"]))
                        loss = (losses["loss"] * weights).mean() / p.grad_accum
                        scaler.scale(loss).backward()
                    with torch.no_grad():
                        # Log sums over finite losses only (a skipped NaN step would poison the window's mean).
                        ok = torch.isfinite(losses["loss"])
                        finite = [torch.where(ok, losses[k].detach(), 0.0) for k in ("loss", "mse", "vb")]
                        stats += torch.stack([f.sum().double() for f in finite] + [ok.sum().double()])
                        q = (t * 4 // diffusion.num_timesteps).clamp(max=3)
                        quart[0].index_add_(0, q, finite[0].double())
                        quart[1].index_add_(0, q, ok.double())

                # Unscale, measure, clip, step; an fp16 overflow step is skipped by the scaler.
                scaler.unscale_(opt)
                if recording and main:
                    grad_rec.capture(done)  # after all-reduce and unscale; before clipping, which scales in place
                clip = p.grad_clip if p.grad_clip > 0 else math.inf
                total_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), clip)
                skipped = False
                if not scaler.is_enabled() and p.on_nonfinite == "skip":
                    # One host sync per step: an exact skip (AdamW moments and step count, EMA and its
                    # warmup count untouched) must be decided before stepping, and masking AdamW on the
                    # device would copy its whole state every step. The fp16 GradScaler syncs here too.
                    skipped = not bool(torch.isfinite(total_norm))
                elif not scaler.is_enabled():
                    # No sync: note the first bad step on the device; it is read before anything is
                    # logged or saved, so a poisoned model is never written.
                    first_nonfinite = torch.where(torch.isfinite(total_norm) | (first_nonfinite > 0),
                                                  first_nonfinite, step + 1)
                if not skipped:
                    scaler.step(opt)
                scaler.update()
                skipped = skipped or (scaler.is_enabled() and scaler.get_scale() < loss_scale)
                opt.zero_grad(set_to_none=True)

                # Update the EMA weights (not on skipped steps: the weights did not move).
                if skipped:
                    skipped_steps += 1
                    if main and not scaler.is_enabled():
                        log.warning("step %d: non-finite gradient norm under %s; update skipped (%d so far)",
                                    step + 1, p.precision, skipped_steps)
                else:
                    for rate, update in ema_updaters.items():
                        update(ema_decay(rate, ema_updates, p.ema_warmup))
                    ema_updates += 1

                if recording:
                    act_rows = act_rec.collect()  # a collective under DDP: every rank calls it
                    if main:
                        param_rows, step_row = grad_rec.finish(total_norm=total_norm, clip_threshold=p.grad_clip,
                                                               skipped=skipped, loss_scale=loss_scale, lr=lr_at(step, p))
                        writer.add(done, params=param_rows, summary=step_row, activations=act_rows,
                                   dumps=act_rec.take_dumps())

                # Log: one host copy per log step.
                imgs_since += p.batch_per_proc * p.grad_accum * world
                stop_now = _agree(stop.requested)
                # Not at a stop: logs stay at the steps an uninterrupted run logs (the sums are checkpointed).
                log_now = done % p.log_every == 0 or done == p.steps
                save_now = done % p.checkpoint_every == 0 or done == p.steps or stop_now
                if (log_now or save_now) and int(first_nonfinite) > 0:  # same value on every rank (all-reduced grads)
                    raise FloatingPointError(
                        f"non-finite gradient norm at step {int(first_nonfinite)} under {p.precision}; stopped "
                        f"without saving past step {saved_step}. Lower train.lr, or set train.on_nonfinite: skip, "
                        "and rerun to resume")
                if log_now:
                    if world > 1:
                        dist.all_reduce(stats)
                        dist.all_reduce(quart)
                    s, qs = stats.cpu().tolist(), quart.cpu().tolist()
                    now = time.perf_counter()
                    summary = {
                        "step": done, **{k: s[i] / s[3] if s[3] else math.nan for i, k in enumerate(("loss", "mse", "vb"))},
                        **{f"loss_q{i}": qs[0][i] / qs[1][i] for i in range(4) if qs[1][i]},
                        "grad_norm": float(total_norm), "lr": lr_at(step, p), "loss_scale": loss_scale,
                        "skipped_steps": skipped_steps, "images_per_sec": imgs_since / (now - t_last),
                    }
                    stats.zero_(), quart.zero_()
                    t_last, imgs_since = now, 0
                    if main:
                        live.step = done
                        for k, v in summary.items():
                            if k != "step":
                                live.log_metric(k, v)
                        live.next_step()
                        progress(done, summary)

                # Checkpoint atomically every k steps, at the end, and when asked to stop.
                if save_now:
                    apply_pending_updates()
                    sums = _gather_rows(torch.cat([stats, quart.flatten()]), world)  # a collective
                    state = {
                        "step": done, "model": raw_model.state_dict(), "optimizer": opt.state_dict(),
                        "scaler": scaler.state_dict(), "ema": {str(r): e for r, e in emas.items()},
                        "sampler": sampler.state_dict(), "ema_updates": ema_updates,
                        "skipped_steps": skipped_steps, "log_sums": sums, "summary": _without_timing(summary),
                        "rng": {"torch": torch.get_rng_state()},
                        "run_hash": run_id, "code_version": version, "params": params.to_dict(),
                    }
                    if main:
                        # Tables first: a kill between the two then resumes from the previous
                        # checkpoint, which drops the rows after it. (Checkpoint first, a kill
                        # mid-flush lost the rows up to this step for good: a resume never redoes them.)
                        writer.flush()
                        ckpt.save_checkpoint(state, ckpt_dir, done, keep=p.keep_checkpoints)
                    D.barrier()
                    saved_step = done
                if stop_now and done < p.steps:
                    if main:
                        writer.close()
                        print(f"stopped at step {done}/{p.steps}; checkpoint saved in {ckpt_dir}. "
                              "Rerun the same command (or `dvc repro`) to resume.", file=sys.stderr)
                    raise SystemExit(130)

        # Export the final weights (safetensors) and the resolved params: the DVC outputs.
        if main:
            writer.close()
            live.end()
            _export(paths.model_dir, raw_model, emas, params, manifest, version, run_id, summary)
            files.copy_dir(work_live, paths.live_dir)
            files.copy_dir(work_tables, paths.introspect_dir)
        D.barrier()
    D.cleanup()
    return summary


def _refuse_interrupted_run_of_other_code(ckpt_dir: Path, steps: int) -> None:
    """An interrupted run of these params and data under other code can be neither resumed
    (it would mix two versions of the code) nor silently abandoned: the user decides."""
    for other in sorted(ckpt_dir.parent.glob("*")):
        latest = ckpt.latest_checkpoint(other) if other != ckpt_dir and other.is_dir() else None
        if latest is not None and ckpt.checkpoint_step(latest) < steps:
            raise files.CheckpointError(
                f"{latest}: an interrupted run of these params under code version {other.name} (this code is "
                f"{ckpt_dir.name}); rerun with `ddpmrepro train --restart` to start over with this code "
                "(that checkpoint is kept), or restore that code to resume it")


def _gather_rows(x: torch.Tensor, world: int) -> torch.Tensor:
    """(world, *x.shape) on the host: row r is rank r's `x` (every rank must call it)."""
    if world == 1:
        return x[None].cpu()
    rows = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(rows, x)
    return torch.stack(rows).cpu()


def _agree(flag: bool) -> bool:
    """Every rank stops at the same step if any rank was asked to (one tiny all-reduce)."""
    if D.world_size() == 1:
        return flag
    return D.all_reduce_max(float(flag)) > 0


def _without_timing(summary: dict) -> dict:
    """The logged values without the throughput: a timing would give the model directory (and the
    checkpoints) new bytes on every rerun of the same training. It stays in dvclive's files and metrics.json."""
    return {k: v for k, v in summary.items() if k != "images_per_sec"}


def _export(model_dir: Path, raw_model, emas, params: Params, manifest, version, run_id, summary) -> None:
    from ..model_dir import data_section, write_model

    config = {
        "params": params.to_dict(), "data": data_section(manifest),
        "data_sha256": manifest["files"], "code_version": version, "run_hash": run_id,
        "ema_rates": list(emas), "final": _without_timing(summary), "torch": torch.__version__,
    }
    write_model(model_dir, config, raw_model.state_dict(), emas)


def _progress(main: bool, start: int, total: int):
    """A tqdm bar with ETA in a terminal; plain periodic lines otherwise (logs, CI, SLURM)."""
    if not main:
        return lambda done, summary: None
    if sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=total, initial=start, desc="train", dynamic_ncols=True)

        def update(done, summary):
            bar.update(done - bar.n)
            bar.set_postfix(loss=f"{summary['loss']:.4f}", img_s=f"{summary['images_per_sec']:.0f}")
            if done == total:
                bar.close()
        return update
    t0 = time.perf_counter()

    def line(done, summary):
        el = time.perf_counter() - t0
        eta = el / max(1, done - start) * (total - done)
        print(f"step {done}/{total} loss {summary['loss']:.4f} mse {summary['mse']:.4f} "
              f"grad_norm {summary['grad_norm']:.3f} lr {summary['lr']:.2e} "
              f"{summary['images_per_sec']:.0f} img/s eta {eta:.0f}s", file=sys.stderr, flush=True)
    return line

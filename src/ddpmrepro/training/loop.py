"""The training loop: one function, top to bottom, one comment per phase.

This is the only module that puts DDP, autocast and the GradScaler together with the method's
pieces, each an object the loop calls in one place: the EMA (`ema.py`), the timestep sampler
(`timestep_sampler.py`), the statistics of the log line (`stats.py`), introspection
(`recording.py`), the non-finite policy (`nonfinite.py`), and `CheckpointIO` (`checkpoint.py`),
the one list of what a checkpoint holds. The UNet and the diffusion math stay pure.

Reproducibility: each example's draws come from its own seed (`batches.py`), so a resumed run
draws exactly the numbers an uninterrupted run would have drawn (the checkpoint only needs the
step), and 2 processes x batch B see exactly the examples and draws of 1 process x batch 2B.
Dropout masks come from the global RNG, reseeded per (seed, step, rank).
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
from torch.nn.parallel import DistributedDataParallel as DDP

from .. import files, outputs, tables
from ..data import load_prepared
from ..runtime import stop_file
from ..model.diffusion import from_params as diffusion_from_params
from ..model.superres import build_superres
from ..model.unet import build_unet
from ..model_dir import data_section, write_model_into
from ..params import SUPERRES_TRAIN_KEYS, Params, ParamsError, trained_dict
from ..runtime import compilation
from ..runtime import distributed as D
from ..runtime.autocast_network import with_precision
from ..runtime.memory_layout import memory_layout
from . import checkpoint as ckpt
from .batches import TrainBatches, TrainExamples, step_seed
from .code_version import code_version
from .cuda_graphs import MicrobatchGraph
from .ema import EMA
from .learned_weighting import loss_weighting
from .noise_levels import bucket_layout
from .noise_scale import NoiseScale
from .nonfinite import NonfiniteSteps
from .phema import PowerEMA
from .recording import Introspection
from .stats import RunningStats
from .timestep_sampler import DeferredUpdates, check_steers, create_sampler
from .train_log import TrainLog

log = logging.getLogger("ddpmrepro.training.loop")

# Keys that change how often we log or save, or how failures are handled, not what is learned:
# they must not invalidate a checkpoint or the run hash. (`on_nonfinite: error` saves nothing
# after a non-finite step, so a run stopped by it resumes under `skip` exactly as a `skip` run.)
OPERATIONAL_TRAIN_KEYS = ("checkpoint_every", "keep_checkpoints", "log_every", "on_nonfinite", "max_restarts")


# Keys added after runs existed: hashed only when not at this value (what every earlier run did), so
# those runs keep their hash. Compiled kernels and NHWC convolutions round differently (the last bits,
# not what is learnt); train.cuda_graphs' all-reduce is not DDP's; train.hflip, set, overrides the data's rule.
HASHED_ONLY_WHEN_ON = {"compile": "none", "cuda_graphs": False, "channels_last": False, "hflip": None}


@dataclass(frozen=True)
class TrainPaths:
    data_dir: Path
    model_dir: Path
    live_dir: Path
    introspect_dir: Path
    checkpoint_root: Path


def run_hash(params: Params, data_digest: str, processes: int | None = None) -> str:
    """Identifies what a checkpoint was trained with (the run's checkpoint directory).

    :param processes: the run's process count (world size) where it is not train.nproc, i.e. on
        several nodes: the global batch, so the data order and every draw, depends on it, and a
        run resumed (or found finished) on another number of nodes would mix two experiments. On
        one node the hash is what it always was."""
    import hashlib

    d = params.to_dict()
    # train.nodes enters as `processes`, the world size a run really has (a one-node hash is as before).
    train = {k: v for k, v in d["train"].items()
             if k not in OPERATIONAL_TRAIN_KEYS and k != "nodes"
             and (k not in HASHED_ONLY_WHEN_ON or v != HASHED_ONLY_WHEN_ON[k])}
    # The snapshots' dtype changes the run directory's files (not the weights): a run resumed or
    # re-exported with another would mix them. fp32 is what runs before the option wrote.
    if train["posthoc_ema_dtype"] == "fp32" or not train["posthoc_ema"]:
        del train["posthoc_ema_dtype"]
    # Checkpointing changes memory, not one bit of the updates: a run may resume with it switched.
    model = {k: v for k, v in d["model"].items() if k != "grad_checkpoint"}
    # What is recorded is part of the run's outputs (the gradient tables, made only while training),
    # and the noise-level buckets steer train.timestep_sampler: grad-norm. A run resumed (or found
    # finished) under other introspect settings would hand back the old tables, or mix them.
    if processes is not None and processes != params.train.nproc:
        train["processes"] = processes
    what = {"data": data_digest, "model": model, "diffusion": d["diffusion"], "train": train,
            "introspect": d["introspect"]}
    if params.superres.low_res:  # an upsampler: what it is trained on (a base run's hash is as before)
        what["superres"] = {k: d["superres"][k] for k in SUPERRES_TRAIN_KEYS}
    blob = json.dumps(what, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def flips(p, manifest: dict) -> bool:
    """Whether training mirrors images at random: train.hflip where set, else the data's rule."""
    return bool(manifest.get("hflip_ok", False)) if p.hflip is None else p.hflip


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
    """SIGINT/SIGTERM ask for a checkpoint at the next step boundary; a second SIGINT exits at once.
    A SIGTERM that came under SLURM before the handler was installed (runtime/stop_file.py) asks too."""

    def __init__(self):
        self.requested = False
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)
        if stop_file.signalled_before():  # looked for once the handler is in place: no signal falls between
            self.requested = True
            print("SIGTERM came while the training was starting: saving a checkpoint at the end of the first step",
                  file=sys.stderr, flush=True)
        return self

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt  # second Ctrl-C: leave now; checkpoints are atomic, nothing is corrupted
        self.requested = True
        again = " (Ctrl-C again to exit at once)" if signum == signal.SIGINT else ""  # a scheduler's SIGTERM waits
        print(f"\n{signal.Signals(signum).name} received: saving a checkpoint at the end of this step{again}",
              file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def train(params: Params, paths: TrainPaths, *, restart: bool = False) -> dict:
    """Trains the diffusion model described by `params`; returns the final summary (rank 0)."""
    p, sr = params.train, params.superres
    device = resolve_device(p.device)
    # Refused here, before anything is written, if it cannot work on this machine.
    compiler = compilation.Compiler(p.compile, device, cache_dir=paths.checkpoint_root / "inductor-cache",
                                    key="train.compile")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    D.init(device.type)
    rank, world, main = D.rank(), D.world_size(), D.is_main()

    # Data: every shard verified against the manifest; images stay on disk (read row by row), labels in memory.
    data = load_prepared(paths.data_dir)
    manifest = data.manifest
    labels = torch.as_tensor(data.train_labels, dtype=torch.long)
    num_classes = manifest["num_classes"]
    # Refused here, before anything is written. The data order (drop_last) gives each rank N // W.
    if len(labels) // world < p.batch_per_proc:
        raise ParamsError(f"train.batch_per_proc={p.batch_per_proc} is larger than this rank's "
                          f"{len(labels) // world} training images; lower it")

    # Model, diffusion, optimizer, loss scaler, EMA, timestep sampler.
    torch.manual_seed(p.seed)  # identical initial weights on every rank
    diffusion = diffusion_from_params(params.diffusion)
    shape = dict(image_size=manifest["image_size"], in_channels=manifest["channels"], num_classes=num_classes,
                 learn_sigma=params.diffusion.variance == "learned_range")
    raw_model = (build_superres(params.model, sr, **shape) if sr.low_res else build_unet(params.model, **shape)).to(device)
    layout = memory_layout(raw_model, p.channels_last)  # NHWC before the optimizer, the EMAs and the checkpoint load
    # One fused kernel per step on GPUs; the multi-tensor (foreach) path elsewhere.
    opt = torch.optim.AdamW(raw_model.parameters(), lr=p.lr, weight_decay=p.weight_decay,
                            **({"fused": True} if device.type == "cuda" else {"foreach": True}))
    # EDM2's learned loss weighting u(t) (learned_weighting.py), or the diffusion's own weights as they are.
    weighting = loss_weighting(params.diffusion.loss_weighting, diffusion.alphas_cumprod.numpy(), seed=p.seed,
                               optimizer=opt, device=device)
    scaler = torch.amp.GradScaler(device.type, enabled=p.precision == "fp16")
    ema = EMA(raw_model, p.ema_rates, warmup=p.ema_warmup)
    phema = PowerEMA(raw_model, p.posthoc_ema, count=p.posthoc_ema_snapshots, steps=p.steps,  # EDM2's post-hoc EMA
                     dtype=p.posthoc_ema_dtype)
    ip = params.introspect
    # grad-norm draws by the noise-level buckets that the introspection measures (the same table).
    buckets = bucket_layout(diffusion.alphas_cumprod, ip, p.batch_per_proc * p.grad_accum * world)
    check_steers(params, processes=world)  # grad-norm, on this run's processes: other nodes draw other t
    sampler = create_sampler(p.timestep_sampler, diffusion.num_timesteps, None if buckets is None else buckets[1])
    # Sampler updates are queued and applied just before the next draw: the GPU is never waited for inside a step.
    # (After the EMA copies: output-grad-norm hooks the model's output layer.)
    sampler_updates = DeferredUpdates(sampler, raw_model, grad_accum=p.grad_accum)
    nonfinite = NonfiniteSteps(p.on_nonfinite, p.precision, scaler, device)
    # Running means of the log line, kept on the device (no host sync between log steps).
    stats = RunningStats({"loss": 1, "mse": 1, "vb": 1, "loss_q": 4, "gns_small_sq": 1, "gns_big_sq": 1,
                          "gns_g2": 1, "gns_trace": 1}, device)
    last = LastSummary()  # the last logged values: exported with the model, kept by a rerun that has no step left

    # Resume from the newest checkpoint of this exact run: checkpoints/<params+data>/<code>/.
    # Other code never touches that directory, so no finished checkpoint is ever overwritten.
    run_id = run_hash(params, manifest["splits"]["train"]["sha256"], processes=world)
    version = code_version()
    ckpt_dir = paths.checkpoint_root / run_id / version
    # The gradient noise scale from the step's microbatches and ranks (hooks; nothing on one batch a step).
    noise_scale = NoiseScale(raw_model, enabled=ip.noise_scale, micro_batch=p.batch_per_proc, grad_accum=p.grad_accum,
                             world=world, halflife_steps=ip.noise_scale_halflife)
    # The recorders' patterns and the noise-level buckets are checked here, before anything is written.
    introspection = Introspection(raw_model, ip, last_step=p.steps, alphas_cumprod=diffusion.alphas_cumprod,
                                  batch_per_step=p.batch_per_proc * p.grad_accum * world, noise_scale=noise_scale,
                                  stats=stats, device=device)
    checkpoint = ckpt.CheckpointIO(model=raw_model, optimizer=opt, scaler=scaler, ema=ema, phema=phema,
                                   sampler=sampler, nonfinite=nonfinite, log_sums=stats, noise_scale=noise_scale,
                                   summary=last, tables=introspection, **weighting.checkpoint_entries())
    if not restart:
        _refuse_interrupted_run_of_other_code(ckpt_dir, p.steps)
    with _run_directory(ckpt_dir, main):
        if main:
            ckpt.remove_stale_temp_files(ckpt_dir)  # of writers killed mid-write (we hold the lock now)
        # After a rank failure, `torchrun --max-restarts` relaunches the same command: resume from
        # the checkpoints this run wrote even if the first launch said --restart.
        relaunched = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
        latest = None if restart and not relaunched else ckpt.latest_checkpoint(ckpt_dir)
        start_step = 0
        if latest is not None:
            # No RNG state to restore: every draw of step s comes from seeds of (seed, s, rank).
            start_step = checkpoint.load(latest, run_hash=run_id, code_version=version)
            if main:
                _report_resume(latest, start_step, checkpoint.saved_params, p, ckpt_dir)
        introspection.open_tables(ckpt_dir / "introspect", start_step)
        compiler(raw_model, eager_inside=introspection.hooked_modules)  # after the EMA copies; hooked blocks stay eager
        # Under train.cuda_graphs the gradients are all-reduced after the backward, not by DDP's hooks inside it.
        model = DDP(raw_model, device_ids=[device.index] if device.type == "cuda" else None) \
            if world > 1 and not p.cuda_graphs else raw_model
        network = with_precision(model, p.precision, device)  # fp16/bf16: autocast, the output back in fp32

        def forward_backward(mb) -> dict:
            """One microbatch's loss and its scaled backward pass: device work only (train.cuda_graphs
            replays it from a CUDA graph). Returns the per-example losses (and the noise scale's sums).
            `loss_scale` is the step's, set in the loop below."""
            model_fn = _model_fn(network, mb.y if params.model.class_cond else None, mb.cond)
            losses = diffusion.training_losses(model_fn, mb.x0, mb.t, noise=mb.noise)
            losses = weighting.weigh(losses, mb.t)  # learned: "loss" = mse / exp(u) + vb, and u
            weighted = weighting.objective(losses) * mb.weights
            # Recorded steps: each noise level's part of the gradient (extra passes, same graph).
            introspection.measure(weighted, mb.t, grad_multiplier=1 / p.grad_accum, loss_scale=loss_scale)
            scaler.scale(weighted.mean() / p.grad_accum).backward()
            return {**losses, **noise_scale.microbatch_sums()}
        microbatch_step = MicrobatchGraph(forward_backward, raw_model, opt, enabled=p.cuda_graphs, device=device)

        # Data order: a per-epoch permutation of (seed, epoch) sharded over ranks (DistributedSampler's);
        # each example's draws from its own seed. Both made ahead on a background thread, off the
        # step's critical path; only the timesteps wait for the sampler's last update.
        examples = TrainExamples(labels, seed=p.seed, rank=rank, world=world, num_classes=num_classes,
                                 label_dropout=p.label_dropout, hflip=flips(p, manifest),
                                 superres=sr, pin=device.type == "cuda")
        batches = TrainBatches(data.train_images, batch_size=p.batch_per_proc, world=world, rank=rank, seed=p.seed,
                               device=device, prepare=examples.draws)
        train_log = TrainLog(ckpt_dir / "live", start_step=start_step, total_steps=p.steps, main=main,
                             images_per_step=p.batch_per_proc * p.grad_accum * world)
        saved_step = start_step

        with StopRequest() as stop, introspection, noise_scale, batches:
            for step in range(start_step, p.steps):
                done = step + 1  # updates completed after this one: the step number of logs, tables, checkpoints
                # Dropout masks of this step come from (seed, step, rank).
                torch.manual_seed(step_seed(p.seed, step, rank, 0))
                for group in opt.param_groups:
                    group["lr"] = lr_at(step, p)
                loss_scale = scaler.get_scale() if scaler.is_enabled() else 1.0
                introspection.begin(done, loss_scale)

                # Accumulate gradients over microbatches; only the last one all-reduces.
                for micro in range(p.grad_accum):
                    sampler_updates.flush()
                    mb = examples.microbatch(batches.get(step * p.grad_accum + micro), sampler).to(device, layout)
                    sync = contextlib.nullcontext() if (micro == p.grad_accum - 1 or model is raw_model) \
                        else model.no_sync()
                    with sync:  # recorded steps eagerly: their hooks and extra passes are host work
                        losses = microbatch_step(mb, eager=introspection.recording)
                    sampler_updates.add(mb.t, losses["loss"], mb.weights, loss_scale)  # after backward: output-grad-norm
                    noise_scale.after_backward(losses, p.grad_accum / loss_scale)  # this microbatch's own gradient norm
                    # Only finite losses enter the log's means (a skipped NaN step would poison the window's).
                    finite = torch.isfinite(losses["loss"])
                    for name in ("loss", "mse", "vb"):
                        stats.report(name, losses[name], finite)
                    stats.report("loss_q", losses["loss"], finite,
                                 group=(mb.t * 4 // diffusion.num_timesteps).clamp(max=3))

                microbatch_step.all_reduce_grads()  # train.cuda_graphs: DDP's all-reduce, after the backward
                weighting.all_reduce_grads()  # u is not under DDP: its gradient is averaged over ranks here
                # Unscale, measure, clip, step; a non-finite step is skipped or stops the run (nonfinite.py).
                scaler.unscale_(opt)
                introspection.capture(done)  # after all-reduce and unscale; before clipping, which scales in place
                total_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), p.grad_clip if p.grad_clip > 0 else math.inf)
                skipped = nonfinite.step(opt, total_norm, step, loss_scale)
                microbatch_step.zero_grads()  # in place under train.cuda_graphs: a graph writes to them

                # Update the EMA weights (not on skipped steps: the weights did not move).
                if not skipped:
                    ema.update()
                    phema.update()
                if main:  # at train.posthoc_ema_snapshots steps, the last one included, into the run directory
                    phema.snapshot(done, ckpt_dir / "phema", run_hash=run_id)
                gns_step = noise_scale.after_step(stats, total_norm, recorded=introspection.recording)
                # grad-norm learns from the buckets measured this step (the same rows on every rank).
                sampler.update_levels(introspection.end(done, gns_step, total_norm=total_norm, clip_threshold=p.grad_clip,
                                                        skipped=skipped, loss_scale=loss_scale, lr=lr_at(step, p)))

                # Log: one host copy per log step. Not at a stop: logs stay at the steps an
                # uninterrupted run logs (the running sums are checkpointed).
                stop_now = _agree(stop.requested)
                log_now = done % p.log_every == 0 or done == p.steps
                save_now = done % p.checkpoint_every == 0 or done == p.steps or stop_now
                if log_now or save_now:
                    nonfinite.check(saved_step)
                if log_now:
                    means = stats.means()
                    gns = noise_scale.log_values(means, step=done)
                    last.summary = {"step": done, **means, "grad_norm": float(total_norm), "lr": lr_at(step, p),
                                    "loss_scale": loss_scale, "skipped_steps": nonfinite.skipped_steps,
                                    outputs.TIMING: train_log.throughput(done), **gns}
                    train_log.log(done, last.summary)
                    introspection.add_rows(done, loss_weight=weighting.rows(done))  # u(t), if learned

                # Checkpoint atomically every k steps, at the end, and when asked to stop.
                if save_now:
                    sampler_updates.flush()
                    # Tables first: a kill between the two then resumes from the previous checkpoint,
                    # which drops the rows after it. (Checkpoint first, a kill mid-flush lost the rows
                    # up to this step for good: a resume never redoes them.) The checkpoint notes them.
                    introspection.snapshot_tables()
                    state = checkpoint.state_dict(done, run_hash=run_id, code_version=version, params=params.to_dict())
                    if main:
                        ckpt.save_checkpoint(state, ckpt_dir, done, keep=p.keep_checkpoints)
                    D.barrier()
                    saved_step = done
                if stop_now and done < p.steps:
                    if main:
                        introspection.close()
                        print(f"stopped at step {done}/{p.steps}; checkpoint saved in {ckpt_dir}. "
                              "Rerun the same command (or `dvc repro`) to resume.", file=sys.stderr)
                    raise SystemExit(130)

        # Export the final weights (safetensors) and the resolved params: the DVC outputs.
        if main:
            introspection.close()
            train_log.end()
            if note := sampler.end_note(p.steps):
                print(note, file=sys.stderr)
            _export(paths, ckpt_dir, raw_model, ema.export(), params, manifest, version, run_id, last.summary,
                    loss_weight=weighting.export())
        D.barrier()
    D.cleanup()
    return last.summary


class LastSummary:
    """The last logged values: checkpointed (without the throughput) so that a rerun with no step
    left exports the same model directory."""

    def __init__(self):
        self.summary: dict = {}

    def state_dict(self) -> dict:
        return _without_timing(self.summary)

    def load_state_dict(self, state: dict) -> None:
        self.summary = dict(state)


def _model_fn(network, y, cond: dict):
    """The network as the diffusion math calls it, model_fn(x_t, t), with this microbatch's labels
    (None for an unconditional model) and conditioning bound. In fp16/bf16 `network` is the model
    under autocast (`runtime/autocast_network.py`), its output in fp32: the diffusion math runs in
    fp32, outside autocast."""
    def model_fn(x, t):
        return network(x, t, y, **cond)
    return model_fn


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


def _report_resume(latest: Path, step: int, saved: dict, p, ckpt_dir: Path) -> None:
    """Says where the run resumes. train.log_every is operational (a resumed run may log at another
    cadence from then on), so a run found finished hands back the curves it logged, and
    metrics.json's final loss is the mean of that cadence's last window: say so when the params
    (`p`, TrainParams) ask for another than the checkpoint's (`saved`, its params)."""
    if step >= p.steps:  # a rerun, or a training that waited for another of the same run
        log.info("run found finished at step %d (%s): nothing to train, its weights are exported", step, latest)
    else:
        log.info("resuming from %s (step %d)", latest, step)
    logged = (saved.get("train") or {}).get("log_every")
    if step >= p.steps and isinstance(logged, int) and logged != p.log_every:
        print(f"note: train.log_every is {p.log_every}, but this run was found finished at step {step} with its "
              f"curves logged every {logged} steps (and its final loss the mean of the last {logged}): nothing "
              f"is retrained. For the new cadence, delete {ckpt_dir} and train again (to the same weights)",
              file=sys.stderr)


@contextlib.contextmanager
def _run_directory(ckpt_dir: Path, main: bool):
    """The run directory to this training alone (rank 0 holds its lock). Another process training
    the same run (the same params, data and code: two queued experiments that differ only in how they
    sample) is waited for, not refused: what it leaves is this run's, resumed or finished. (Refused,
    the README's sweep of 2 lr x 2 guidance failed one experiment of four under `dvc queue start -j 2`;
    found from outside.) Every rank polls with rank 0, so none waits in a collective past its timeout."""
    lock = ckpt.RunLock(ckpt_dir) if main else None
    waiting = False
    while _agree(not lock.try_lock() if main else False):
        if main and not waiting:
            print(f"waiting for process {lock.holder()}, which is training this same run (params, data and code) "
                  f"into {ckpt_dir}: its checkpoints are this run's", file=sys.stderr, flush=True)
        waiting = True
        time.sleep(1.0)
    try:
        yield
    finally:
        if main:
            lock.release()


def _agree(flag: bool) -> bool:
    """Every rank stops at the same step if any rank was asked to (one tiny all-reduce)."""
    if D.world_size() == 1:
        return flag
    return D.all_reduce_max(float(flag)) > 0


def _without_timing(summary: dict) -> dict:
    """The logged values without the throughput: a timing would give the model directory (and the
    checkpoints) new bytes on every rerun of the same training. It stays in dvclive's files and metrics.json."""
    return {k: v for k, v in summary.items() if k != outputs.TIMING}


def _export(paths: TrainPaths, ckpt_dir: Path, raw_model, emas, params: Params, manifest, version, run_id, summary,
            loss_weight: dict | None = None) -> None:
    """The three outputs: the model directory (model_dir.py owns its format: the weights, the EMAs,
    the post-hoc EMA's snapshots, the learned loss weighting, config.json), dvclive's files and
    the introspection tables (with their sums, which the report checks). All three are written
    before any is put in place, so a failure or a kill while writing leaves the old three; the
    swaps then follow one another (the model directory, which says the run finished, last)."""
    config = {
        "params": trained_dict(params), "data": data_section(manifest),
        "data_sha256": manifest["files"], "code_version": version, "run_hash": run_id,
        "ema_rates": list(emas), "final": _without_timing(summary), "torch": torch.__version__,
        "processes": D.world_size(),  # params say train.nproc per node; this is the run's world size
    }
    snapshots = ckpt_dir / "phema"
    with contextlib.ExitStack() as swaps:  # exits in reverse: the introspection tables first, the model last
        model_tmp = swaps.enter_context(files.replacing_dir(paths.model_dir, outputs.MODEL))
        live_tmp = swaps.enter_context(files.replacing_dir(paths.live_dir, outputs.TRAIN_LOG))
        tables_tmp = swaps.enter_context(files.replacing_dir(paths.introspect_dir, outputs.INTROSPECTION))
        write_model_into(model_tmp, config, raw_model.state_dict(), emas,
                         snapshots=snapshots if snapshots.is_dir() else None, loss_weight=loss_weight)
        files.copy_into(ckpt_dir / "live", live_tmp, shown=paths.live_dir)
        files.copy_into(ckpt_dir / "introspect", tables_tmp, shown=paths.introspect_dir)
        tables.write_sums(tables_tmp)

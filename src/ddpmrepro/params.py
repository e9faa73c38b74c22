"""params.yaml as typed, frozen dataclasses, validated once at load.

Every field declares its type and, where it matters, the allowed values or range.
A wrong key, type or value raises `ParamsError` naming the key's full path and
what is allowed, before any stage writes anything.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .respace import space_timesteps


# The longest post-hoc EMA length, model.phema.MAX_SIGMA_REL = sqrt(1/12) = 0.28868 (the plain
# average), rounded down; written out because params never imports torch (tests/test_phema.py).
_MAX_LENGTH = 0.288


class ParamsError(ValueError):
    """A user error in params.yaml; the message is one line naming the key path."""


def _f(default, *, choices=None, min=None, max=None, min_exclusive=False, doc=""):
    """A dataclass field with validation metadata (lists are copied per instance)."""
    meta = {"choices": choices, "min": min, "max": max, "min_exclusive": min_exclusive, "doc": doc}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class DataParams:
    """Read by `prepare`: which dataset, at what size, split how."""

    source: str = _f("digits", choices=("digits", "mnist5k", "mnist", "fashion_mnist", "cifar10", "image_folder"),
                     doc="The dataset (README, Data sources). `digits` and `mnist5k` ship inside installed "
                         "packages; the others are read from `root`.")
    root: str = _f("data/raw", doc="Where mnist, fashion_mnist, cifar10 and image_folder files live (unused by "
                                   "digits and mnist5k); relative to the project, `~` is your home.")
    image_size: int = _f(8, min=8, max=1024, doc="Output side length in pixels (resized with LANCZOS on the "
                                                 "shorter side, then centre-cropped); at least 8, the evaluator's "
                                                 "smallest input.")
    channels: int = _f(1, choices=(1, 3), doc="1 = grey, 3 = RGB (grey is replicated, colour converted to luma).")
    test_fraction: float = _f(0.2, min=0.0, max=0.9, min_exclusive=True,
                              doc="Held-out share per class, for sources without their own test split.")
    split_seed: int = _f(0, min=0, doc="Seed of that stratified split.")
    download: bool = _f(False, doc="Let torchvision download mnist/fashion_mnist/cifar10 into `root`. Nothing "
                                   "is ever downloaded otherwise.")


@dataclass(frozen=True)
class ModelParams:
    """Read by `train`: a named preset (see unet.PRESETS, `ddpmrepro info --presets`); any key
    given here overrides that preset's value (unset keys are null and take the preset's)."""

    preset: str = _f("tiny", choices=("tiny", "ddpm-cifar10", "iddpm-cifar10"),
                     doc="`tiny`: the CPU default for 8x8 digits; `ddpm-cifar10`: Ho et al. 2020 (35.7M); "
                         "`iddpm-cifar10`: Nichol & Dhariwal 2021 (52.5M with learned sigma).")
    channels: int | None = _f(None, min=1, doc="Base width of the UNet (channels at full resolution).")
    channel_mult: list[int] | None = _f(None, min=1, doc="Width multiplier per resolution level; its length is "
                                                         "the number of levels.")
    num_res_blocks: int | None = _f(None, min=1, doc="Residual blocks per level.")
    attention_resolutions: list[int] | None = _f(None, min=1, doc="Feature-map side lengths (pixels) that get "
                                                                  "self-attention.")
    num_head_channels: int | None = _f(None, min=1, doc="Channels per attention head.")
    dropout: float | None = _f(None, min=0.0, max=1.0, doc="Dropout in the residual blocks.")
    scale_shift_norm: bool | None = _f(None, doc="true: IDDPM's AdaGN (timestep scales and shifts the norm); "
                                                 "false: DDPM's additive embedding.")
    # Switches that reproduce published models exactly (docs/MODELS.md); null = this UNet's own choice.
    time_embedding: str | None = _f(None, choices=("iddpm", "ddpm"),
                                    doc="Sinusoidal timestep embedding: `iddpm` (default; [cos, sin], frequencies "
                                        "1e4^(-i/half)) or `ddpm` (the TF release of Ho et al.: [sin, cos], "
                                        "1e4^(-i/(half-1))).")
    downsample_padding: str | None = _f(None, choices=("symmetric", "asymmetric"),
                                        doc="Padding of the stride-2 downsampling conv: `symmetric` (default, 1 "
                                            "pixel each side) or `asymmetric` (TF's bottom/right only, as DDPM's "
                                            "release).")
    norm_eps: float | None = _f(None, min=0.0, min_exclusive=True, max=1.0,
                                doc="GroupNorm epsilon (default 1e-5; DDPM's TF release: 1e-6).")
    num_heads: int | None = _f(None, min=1, doc="A fixed number of attention heads in every attention layer "
                                                "(improved-diffusion's `num_heads`); replaces num_head_channels.")
    num_heads_upsample: int | None = _f(None, min=1, doc="A fixed number of attention heads in the up path's "
                                                         "attention layers only (improved-diffusion's "
                                                         "`num_heads_upsample`); null: as the other layers.")
    resblock_updown: bool | None = _f(None, doc="true: resample with residual blocks (average pool / nearest inside "
                                                "the block, guided-diffusion's ADM) instead of strided / upsampling "
                                                "convs. Default false.")
    class_cond: bool = _f(True, doc="false: an unconditional model (no label table; sample.guidance is not used "
                                    "and evaluate reports class_acc as null).")

    grad_checkpoint: bool = _f(False, doc="Recompute each residual and attention block's activations in backward "
                                          "instead of keeping them: less memory for about one more forward pass "
                                          "per step, bitwise the same gradients (docs/BENCHMARKS.md, Gradient "
                                          "checkpointing). Operational: not part of the run hash.")

    # Keys that are not a preset's (the presets give every other key).
    NOT_ARCHITECTURE = ("preset", "class_cond", "grad_checkpoint")

    def overrides(self) -> dict:
        """The architecture keys set explicitly in params.yaml."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in self.NOT_ARCHITECTURE and v is not None}


@dataclass(frozen=True)
class SuperresParams:
    """Read by `train`, `sample` and `evaluate-superres`: with `low_res` > 0 the model is IDDPM's
    super-resolution UNet, trained to make data.image_size images from low_res ones and sampled
    from low-res inputs (docs/SUPERRES.md). 0: the base model, as without this section."""

    low_res: int = _f(0, min=0, doc="Side of the low-resolution input (area-downsampled from the prepared "
                                    "images); 0: no super-resolution. Must be smaller than data.image_size.")
    quantise: bool = _f(True, doc="Round the training low-res input to 8 bits, as sampling sees it (a base "
                                  "run's uint8 samples, or uint8 test images downsampled and rounded); "
                                  "false: IDDPM's float input.")
    noise_aug: float = _f(0.2, min=0.0, max=1.0, doc="Training: Gaussian noise of std drawn uniformly in "
                                                     "[0, noise_aug] (image range [-1, 1]) is added to the low-res "
                                                     "input and the std given to the network (Cascaded Diffusion "
                                                     "Models); 0: none, IDDPM's model exactly.")
    sample_noise_aug: float = _f(0.1, min=0.0, max=1.0, doc="Sampling: the noise std added to every low-res "
                                                            "input (and told to the network); at most noise_aug.")
    project: bool = _f(False, doc="Sampling: replace each output's low frequencies by its input's (the "
                                  "nearest image in [-1, 1] whose area-downsampling is the input), so the "
                                  "output downsampled back is the input up to rounding; false: the network's "
                                  "output as it is. No retraining (docs/SUPERRES.md, Consistency).")
    low_res_from: str = _f("test", doc="Sampling input: `test` (the test split, downsampled, so that PSNR/SSIM "
                                       "against the truth exist) or the path of a base run's samples.npz (the "
                                       "cascade).")


@dataclass(frozen=True)
class DiffusionParams:
    """Read by `train` (and by `sample`/`evaluate` through the trained model's config.json)."""

    timesteps: int = _f(1000, min=2, max=100_000, doc="T, the number of diffusion steps. `sample.respacing` "
                                                      "must be able to respace it.")
    schedule: str = _f("cosine", choices=("linear", "cosine"), doc="Beta schedule: DDPM's linear (scaled to T) "
                                                                   "or IDDPM's cosine.")
    prediction: str = _f("eps", choices=("eps", "x0"), doc="What the network predicts: the noise or the clean image.")
    variance: str = _f("fixed_small", choices=("fixed_small", "fixed_large", "learned_range"),
                       doc="Reverse-process variance: the posterior's (small), beta_t (large), or IDDPM's "
                           "learned interpolation between them (doubles the output channels).")
    loss: str = _f("mse", choices=("mse", "hybrid", "kl"), doc="`mse` (DDPM's simple loss), `hybrid` (mse + "
                                                                "VLB x T/1000, IDDPM) or `kl` (the VLB alone).")
    loss_weighting: str = _f("none", choices=("none", "min_snr", "p2", "learned"),
                             doc="Per-timestep weight of the MSE term (docs/TRAINING.md, Loss weighting): `none` "
                                 "(L_simple), `min_snr` (Hang et al. 2023) or `p2` (Choi et al. 2022), each in its "
                                 "form for `prediction`, or `learned` (EDM2, Karras et al. 2024: mse / exp(u_t) + "
                                 "u_t with u a learned function of log-SNR, trained with the model; "
                                 "training/learned_weighting.py). The VLB term of `hybrid` (or of a learned "
                                 "variance) stays unweighted; not with `loss: kl`.")
    # The three keys below are null unless their weighting is chosen: null there means the paper's value,
    # which load writes in (so the saved params, config.json and the run hash name the value used).
    min_snr_gamma: float | None = _f(None, min=0.0, min_exclusive=True,
                                     doc="min_snr's gamma: the weight of the x0 MSE is min(SNR_t, gamma). Only with "
                                         "`loss_weighting: min_snr`; null there: 5 (the paper's).")
    p2_k: float | None = _f(None, min=0.0, min_exclusive=True,
                            doc="p2's k: the weight of the eps MSE is 1/(k + SNR_t)^gamma; k > 0 bounds it at the "
                                "noisiest steps. Only with `loss_weighting: p2`; null there: 1 (the paper's).")
    p2_gamma: float | None = _f(None, min=0.0, min_exclusive=True,
                                doc="p2's gamma (0 would be `none`). Only with `loss_weighting: p2`; null there: 1 "
                                    "(the paper's; it also uses 0.5).")
    rescale_timesteps: bool = _f(False, doc="Feed the network t x 1000/T instead of the index t "
                                            "(improved-diffusion's `rescale_timesteps`; its CIFAR-10 models need "
                                            "it).")


@dataclass(frozen=True)
class TrainParams:
    """Read by `train`. Steps count completed optimizer updates, everywhere."""

    seed: int = _f(0, min=0, doc="Initial weights, data order and every per-example draw derive from it.")
    steps: int = _f(1500, min=1, doc="Optimizer updates to run. Part of the run's hash (the learning-rate anneal "
                    "depends on it): raising it trains a new run from step 0, not on from the last checkpoint.")
    batch_per_proc: int = _f(128, min=1, doc="Images per process per microbatch; the global batch is "
                                             "batch_per_proc x nproc x nodes x grad_accum.")
    grad_accum: int = _f(1, min=1, doc="Microbatches accumulated per optimizer update.")
    nproc: int = _f(1, min=1, max=1024, doc="Processes per node (one per GPU); > 1 runs under torchrun. "
                                            "`ddpmrepro train --nproc` overrides it.")
    nodes: int = _f(1, min=1, max=1024, doc="Nodes, one torchrun of nproc processes each: part of the run (the "
                                            "global batch), so DVC sees it. On SLURM, Snakemake asks for this many "
                                            "nodes; `ddpmrepro train` refuses an allocation of another size "
                                            "(docs/CLUSTER.md). `--nnodes` overrides it.")
    device: str = _f("auto", choices=("auto", "cpu", "cuda"), doc="`auto`: CUDA when visible, else CPU.")
    precision: str = _f("fp32", choices=("fp32", "fp16", "bf16"), doc="fp16: autocast + GradScaler (overflow "
                                                                       "steps skipped and counted); bf16: autocast.")
    lr: float = _f(2e-3, min=0.0, min_exclusive=True, max=1.0, doc="AdamW learning rate after warmup.")
    warmup_steps: int = _f(100, min=0, doc="Linear warmup from lr/warmup_steps to lr.")
    anneal: str = _f("linear", choices=("none", "linear"), doc="After warmup: constant, or linear towards 0: "
                                                               "update s (from 0) uses lr (1 - (s - warmup_steps) / (steps - "
                                                               "warmup_steps)), the last one lr / (steps - "
                                                               "warmup_steps).")
    weight_decay: float = _f(0.0, min=0.0, doc="AdamW's decoupled weight decay.")
    grad_clip: float = _f(1.0, min=0.0, doc="Clip the global gradient norm (measured after unscaling) to this; "
                                            "0 disables.")
    ema_rates: list[float] = _f([0.999], doc="EMA decay rates kept (one weights file each); at least one, each "
                                             "in (0, 1).")
    ema_warmup: bool = _f(True, doc="Use decay min(rate, (1+n)/(10+n)) after n updates, so early EMAs follow "
                                    "the weights.")
    posthoc_ema: list[float] = _f([0.05, 0.10], min=0.0, min_exclusive=True, max=_MAX_LENGTH,
                                  doc="EDM2's post-hoc EMA (docs/POSTHOC_EMA.md): the lengths (relative standard "
                                      "deviations) of the power-function EMAs tracked, whose snapshots let "
                                      "`sample.ema_length` choose a length after training; [] tracks none.")
    posthoc_ema_snapshots: int = _f(32, min=1, doc="Snapshots of each post-hoc EMA over the run, evenly spaced, "
                                                   "the last at the last step; each is one weights file per "
                                                   "length in models/ddpm/phema/. The reconstruction error falls "
                                                   "fast with their number (docs/POSTHOC_EMA.md).")
    posthoc_ema_dtype: str = _f("fp16", choices=("fp16", "bf16", "fp32"),
                                doc="What the snapshot files store (the averages are tracked in fp32 and "
                                    "reconstructed in fp64 whatever it is): fp16 halves fp32's bytes and moves "
                                    "a reconstructed average by 1.4e-4 to 6.8e-4 (relative L2; FID by 0.002), "
                                    "5 to 100 times less than a step of 0.015 in the length does; bf16 by 8 "
                                    "times more (docs/POSTHOC_EMA.md, Snapshot precision). Part of the run hash "
                                    "unless fp32.")
    compile: str = _f("none", choices=("none", "blocks"),
                      doc="`blocks`: torch.compile each residual and attention block's forward (regional "
                          "compilation; docs/BENCHMARKS.md has when it pays). Needs a C++ compiler on CPU, "
                          "Triton on GPUs. Inductor's caches go to CHECKPOINTS/inductor-cache.")
    cuda_graphs: bool = _f(False, doc="Capture each microbatch's forward, loss and backward in a CUDA graph once "
                                      "and replay it: one launch instead of thousands, for steps bound by the host "
                                      "(docs/TRAINING.md, CUDA graphs). Recorded introspection steps run eagerly; "
                                      "the gradients are all-reduced after the backward instead of by DDP during "
                                      "it. On a CPU the same code runs without capture. Part of the run hash when "
                                      "on.")
    channels_last: bool = _f(False, doc="The model's weights and each microbatch's images in the NHWC layout "
                                        "(`torch.channels_last`), which cuDNN's bf16/fp16 convolutions run "
                                        "without transposes; on a CPU it was slower (docs/BENCHMARKS.md). Changes "
                                        "the last bits of the run, not what it learns; exported weights are "
                                        "stored in the usual layout. Part of the run hash when on.")
    timestep_sampler: str = _f("loss-second-moment",
                               choices=("uniform", "loss-second-moment", "grad-norm", "output-grad-norm"),
                               doc="IDDPM's importance sampling: p_t proportional to sqrt(E[L_t^2]) over the "
                                   "last 10 losses per t, uniform until all are filled; `grad-norm`: p_t "
                                   "proportional to sqrt(E|grad L_t|^2), each noise-level bucket's gradient "
                                   "(measured by the introspection's buckets on their steps: needs them on) "
                                   "spread over its t by that loss history; "
                                   "`output-grad-norm`: the same per t from the last 10 per-example gradient "
                                   "norms of the output layer, on every step (docs/INTROSPECTION.md, Balancing "
                                   "the noise levels).")
    label_dropout: float = _f(0.1, min=0.0, max=1.0, doc="Share of labels replaced by the null class "
                                                         "(classifier-free guidance).")
    hflip: bool | None = _f(None, doc="Mirror each training image left to right with probability 1/2. null: the "
                                      "dataset's rule (`hflip_ok` in the manifest: true for cifar10 and image "
                                      "folders, false for digits and MNIST, which a mirror changes); false for "
                                      "images a mirror changes (text, arrows, left/right classes); true to flip "
                                      "anyway. Part of the run hash when set.")
    checkpoint_every: int = _f(500, min=1, doc="Save a resumable checkpoint every k steps (and at the end "
                                               "and on Ctrl-C/SIGTERM). Operational: not part of the run hash.")
    keep_checkpoints: int = _f(2, min=1, doc="Newest checkpoints kept. Operational.")
    log_every: int = _f(25, min=1, doc="dvclive point every k steps (and at the last): means over the window. "
                                       "Operational: a run found finished keeps the curves it logged (a note "
                                       "says so).")
    on_nonfinite: str = _f("error", choices=("error", "skip"), doc="A NaN/inf gradient norm under fp32/bf16: "
                                                                   "`error` stops without saving past it, "
                                                                   "`skip` skips the update and counts it. "
                                                                   "Operational.")
    max_restarts: int = _f(0, min=0, max=100, doc="Under torchrun: relaunch all ranks this often after one fails "
                                                  "(they resume from the last checkpoint). Operational.")
    import_from: str = _f("", doc="A published model to evaluate instead of training one (docs/MODELS.md): a .pt "
                                  "file or diffusers folder under models/published/ (`dvc add` it); the train stage "
                                  "then imports it into models/ddpm and trains nothing. '' trains.")
    import_format: str = _f("improved-diffusion", choices=("improved-diffusion", "guided-diffusion", "diffusers"),
                            doc="The format of `import_from`.")


@dataclass(frozen=True)
class IntrospectParams:
    """Read by `train`: which gradients to record, and when (docs/INTROSPECTION.md). Steps count
    completed updates: step N is the N-th update, as in dvclive and the checkpoints."""

    every: int = _f(25, min=0, doc="Record every k-th step and the last step; 0: only `steps` and `dump_steps`.")
    steps: list[int] = _f([1], min=1, doc="Extra steps to record, each in 1..train.steps (1 = the first update).")
    params: list[str] = _f(["*"], doc="Parameter names to record: fnmatch globs or `re:REGEX`; each must match.")
    update_ratio: bool = _f(True, doc="Also record ||p_new - p_old|| / ||p_old|| (one copy of the recorded "
                                      "parameters per recorded step).")
    modules: list[str] = _f(["input_blocks.*", "middle_block", "output_blocks.*", "out"],
                            doc="Modules whose activation gradients are hooked (outermost glob matches, or "
                                "`re:REGEX`); each must match.")
    histogram_bins: int = _f(0, min=0, max=1024, doc="> 0: a histogram of log10|g| per activation gradient.")
    dump_steps: list[int] = _f([], min=1, doc="Steps (1..train.steps) at which the full activation gradients "
                                              "of `dump_modules` are saved; they are recorded steps too.")
    dump_modules: list[str] = _f([], doc="Modules to dump, among the hooked `modules`; needed by `dump_steps`.")
    dump_max_mb: float = _f(16.0, min=0.0, doc="Cap on dumped megabytes per step; later tensors are skipped "
                                               "with a warning.")
    noise_scale: bool = _f(True, doc="Measure the gradient noise scale B_simple (McCandlish et al. 2018) on every "
                                     "step that has two batch sizes (train.grad_accum >= 2 or several processes: "
                                     "hooks, no extra pass); otherwise it comes from the noise-level buckets' halves "
                                     "on their steps. Logged as gns_g2, gns_trace, gns_b_simple (and in the steps "
                                     "table); false: none of them, from either source.")
    noise_scale_halflife: float = _f(500.0, min=1.0, doc="Half-life in steps of the averages of |G|² and tr(Σ) "
                                                         "whose ratio is the logged gns_b_simple.")
    noise_buckets: int | None = _f(None, min=0, max=64, doc="On the steps of `noise_levels_every`, split the "
                                                            "batch's gradient into "
                                                            "this many noise-level buckets of equal width in "
                                                            "`noise_bucket_space` (the noise_levels table: norms, "
                                                            "shares, conflicts, noise scales); 0: off; null: 4, or as "
                                                            "many (down to 1) as let each expect 2 examples per step "
                                                            "at the batch. Costs 2 x buckets extra backward passes "
                                                            "on each of those steps.")
    noise_bucket_edges: list[float] = _f([], doc="Interior bucket edges instead (ascending, in "
                                                 "`noise_bucket_space` units): N edges make N + 1 buckets.")
    noise_bucket_space: str = _f("t", choices=("t", "logsnr"), doc="Bucket edges in timesteps t, or in log-SNR "
                                                                   "log(alpha_bar / (1 - alpha_bar)).")
    noise_levels_every: int = _f(250, min=1, doc="The noise-level buckets on the recorded steps whose number is a "
                                                 "multiple of k, on `steps` and on the last: each such step costs "
                                                 "about 6 unrecorded ones on `tiny`, so at every recorded step they "
                                                 "would add 20% to the default run (docs/INTROSPECTION.md, Cost); "
                                                 "1: on every recorded step.")


@dataclass(frozen=True)
class SampleParams:
    """Read by `sample` (`ema_rate`, `ema_length` and `ema_step` by `evaluate` too)."""

    ema_rate: float = _f(0.999, min=0.0, max=1.0, doc="Which trained EMA weights to sample from; 0 = the raw "
                                                      "weights.")
    ema_length: float | None = _f(0.0, min=0.0, max=_MAX_LENGTH,
                           doc="> 0: sample from the post-hoc EMA of this length (relative standard deviation, "
                               "e.g. 0.08), reconstructed from the snapshots of `train.posthoc_ema` instead of "
                               "`ema_rate`'s weights (docs/POSTHOC_EMA.md); 0 or null = `ema_rate`.")
    ema_step: int = _f(0, min=0, doc="With `ema_length`: the post-hoc EMA as it stood after this step (one of the "
                                     "snapshot steps of `train.posthoc_ema_snapshots`), made from the snapshots "
                                     "up to it: quality over training from one run (docs/POSTHOC_EMA.md); 0 = the "
                                     "last step.")
    per_class: int = _f(50, min=1, doc="Images per class.")
    sampler: str = _f("ddim", choices=("ddim", "ddpm", "dpmpp_2m", "dpmpp_2m_sde", "unipc", "heun"),
                      doc="Ancestral DDPM sampling, DDIM, or the fast solvers of docs/SAMPLERS.md: "
                          "DPM-Solver++(2M), its SDE variant, UniPC (bh2) and EDM's Heun.")
    respacing: str = _f("ddim50", doc="Timesteps to sample on (IDDPM's rule, src/ddpmrepro/respace.py): '' (all T), "
                                      "'ddimN' (an integer stride giving exactly N steps), or steps per "
                                      "section like '10,15,20' (each between 1 and its section's length); "
                                      "checked against diffusion.timesteps. ddpm and ddim always sample on "
                                      "these steps; the fast solvers only with `spacing: respacing`.")
    nfe: int = _f(20, min=3, doc="Network calls of the fast solvers (with guidance one call is one doubled "
                                 "batch). heun makes 2M-1 calls for M points, so an even budget runs one call "
                                 "less. ddpm and ddim take their steps from `respacing` instead.")
    spacing: str = _f("logsnr", choices=("logsnr", "time_uniform", "karras", "respacing"),
                      doc="Fast solvers' evaluation points: uniform in log-SNR (DPM-Solver's), in the index, "
                          "EDM's rho=7 steps, or the integer steps of `respacing` (nfe unused).")
    lambda_min: float = _f(-5.1, max=-2.3, doc="Fast solvers start where the half log-SNR lambda of the table "
                                               "reaches this (cosine tails fall to -9.9 at T=1000, pure noise); -5.1 "
                                               "as dpm-solver and diffusers. At most -2.3: sampling starts from pure "
                                               "noise N(0, I), right only where the signal's scale alpha is near 0 "
                                               "(0.1 at -2.3; 0.71 at 0, where the images come out wrong). Not used "
                                               "with `spacing: respacing`.")
    eta: float = _f(0.0, min=0.0, max=1.0, doc="DDIM's eta: 0 deterministic, 1 DDPM-like noise.")
    thresholding: str = _f("static", choices=("static", "dynamic", "none"),
                           doc="The x0 estimate at every step: clamped to [-1, 1] (ddpm/ddim's clip_denoised), "
                               "Imagen's dynamic thresholding (99.5% quantile per image; fast solvers only), "
                               "or left as is.")
    churn: float = _f(0.0, min=0.0, doc="heun only: EDM's S_churn (0 = the deterministic ODE); each step first "
                                        "adds noise raising sigma by min(churn/M, sqrt(2)-1).")
    guidance: float = _f(0.5, min=0.0, doc="Classifier-free guidance w in eps = (1+w) eps_c - w eps_u; "
                                           "0 = plain conditional.")
    seed: int = _f(0, min=0, doc="Image k draws its noise from its own generator seeded by (seed, k).")
    batch_size: int = _f(250, min=1, doc="Images per forward pass (does not change the images).")
    nproc: int = _f(1, min=1, max=1024, doc="Processes (GPUs); images are sharded, not changed. "
                                            "`ddpmrepro sample --nproc` overrides it.")
    compile: str = _f("none", choices=("none", "blocks"),
                      doc="`blocks`: torch.compile each residual and attention block's forward; the images "
                          "agree with eager ones within float tolerance, not bit for bit. Inductor's caches "
                          "go to checkpoints/inductor-cache.")
    cuda_graphs: bool = _f(False, doc="Replay the network's forward from a CUDA graph per batch shape (the "
                                      "sampler's arithmetic stays eager): one launch per network call instead of "
                                      "hundreds (docs/SAMPLERS.md, CUDA graphs). On a CPU the same code runs "
                                      "without capture.")
    channels_last: bool = _f(False, doc="The network's weights in the NHWC layout (`torch.channels_last`), "
                                        "which cuDNN's bf16/fp16 convolutions run without transposes. Moves the "
                                        "images' last bits, not beyond a uint8 level (docs/SAMPLERS.md).")
    precision: str = _f("fp32", choices=("fp32", "bf16", "fp16"),
                        doc="The network's forward in this dtype (autocast; the guidance and the solver stay "
                            "float32): a GPU's tensor cores run bf16/fp16 at a multiple of float32's rate. "
                            "Changes the images (docs/SAMPLERS.md, Precision). Upsampling too.")


@dataclass(frozen=True)
class EvaluatorParams:
    """Read by `fit-evaluator`: the small classifier whose features FID/KID/PR use."""

    seed: int = _f(0, min=0, doc="Initial weights, shuffling and augmentation.")
    epochs: int = _f(30, min=1, doc="Passes over the training split.")
    lr: float = _f(1e-3, min=0.0, min_exclusive=True, doc="Adam learning rate.")
    batch_size: int = _f(128, min=1, doc="Images per step.")


@dataclass(frozen=True)
class EvaluateParams:
    """Read by `evaluate` (see docs/METRICS.md)."""

    bpd_images: int = _f(64, min=0, doc="Test images for bits/dim (full VLB: T forward passes each); 0 skips it.")
    pr_neighbourhood: int = _f(3, min=1, doc="k of the k-nearest-neighbour balls of precision/recall.")
    inception_weights: str = _f("", doc="Local path to the TF-ported inception-2015-12-05 weights for "
                                        "Inception FID/IS; '' skips them (nothing is downloaded).")
    inception_sha256: str = _f("", doc="sha256 of those weights, required with them (it names the weights a "
                                       "paper's numbers used); a file torch's weights_only loader refuses is "
                                       "never unpickled, whatever its sha256.")


@dataclass(frozen=True)
class ReportParams:
    """Read by `report`."""

    top_k: int = _f(8, min=1, doc="Rows drawn as lines in grad_norm_topk.png (largest mean norm).")
    conflict_steps: list[int] = _f([], min=1, doc="Steps whose noise-level conflict matrix "
                                                  "noise_level_conflicts.png draws: steps where the buckets are "
                                                  "measured (check-params refuses others); []: the first, middle "
                                                  "and last measured steps.")


@dataclass(frozen=True)
class Params:
    data: DataParams = field(default_factory=DataParams)
    model: ModelParams = field(default_factory=ModelParams)
    diffusion: DiffusionParams = field(default_factory=DiffusionParams)
    train: TrainParams = field(default_factory=TrainParams)
    introspect: IntrospectParams = field(default_factory=IntrospectParams)
    sample: SampleParams = field(default_factory=SampleParams)
    evaluator: EvaluatorParams = field(default_factory=EvaluatorParams)
    evaluate: EvaluateParams = field(default_factory=EvaluateParams)
    report: ReportParams = field(default_factory=ReportParams)
    superres: SuperresParams = field(default_factory=SuperresParams)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def section_hash(self, *sections: str) -> str:
        """Stable hash of the named sections, e.g. to tie a checkpoint to what it was trained with."""
        d = self.to_dict()
        blob = json.dumps({s: d[s] for s in sections}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


# --- validation -------------------------------------------------------------------------------


def _type_name(tp) -> str:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp) if a is not type(None))
    if typing.get_origin(tp) in (list, typing.List):
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    return {int: "an integer", float: "a number", str: "a string", bool: "true/false"}.get(tp, str(tp))


def _coerce(value: Any, tp, path: str):
    """Checks `value` against the annotation `tp`; ints are accepted where floats are."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp):
        if value is None:
            return None
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return _coerce(value, inner, path)
    if origin in (list, typing.List):
        if not isinstance(value, list):
            raise ParamsError(f"{path}: expected {_type_name(tp)}, got {value!r}")
        (item_tp,) = typing.get_args(tp)
        return [_coerce(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            raise ParamsError(f"{path}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ParamsError(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        # YAML reads `2e-4` (no dot) as a string: accept it, since users write it that way.
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise ParamsError(f"{path}: expected a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ParamsError(f"{path}: expected a number, got {value!r}")
        if value != value or value in (float("inf"), float("-inf")):
            raise ParamsError(f"{path}: expected a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if value is None:
            return ""
        if not isinstance(value, str):
            raise ParamsError(f"{path}: expected a string, got {value!r}")
        return value
    raise TypeError(f"unsupported annotation {tp} at {path}")


def _check_range(value, meta: dict, path: str) -> None:
    if value is None:
        return
    items = [(f"{path}[{i}]", v) for i, v in enumerate(value)] if isinstance(value, list) else [(path, value)]
    for path, v in items:
        choices = meta.get("choices")
        if choices is not None and v not in choices:
            allowed = " | ".join(map(str, choices))
            raise ParamsError(f"{path}: {v!r} is not one of {allowed}")
        lo, hi = meta.get("min"), meta.get("max")
        if lo is not None and (v < lo or (meta.get("min_exclusive") and v == lo)):
            op = ">" if meta.get("min_exclusive") else ">="
            raise ParamsError(f"{path}: must be {op} {lo}, got {v!r}")
        if hi is not None and v > hi:
            raise ParamsError(f"{path}: must be <= {hi}, got {v!r}")


def _build(cls, raw: Any, path: str):
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ParamsError(f"{path or 'params'}: expected a mapping of keys, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        where = f"{path}.{unknown[0]}" if path else unknown[0]
        raise ParamsError(f"{where}: unknown key; allowed keys{' in ' + path if path else ''}: {', '.join(fields)}")
    kwargs = {}
    for name, f in fields.items():
        key_path = f"{path}.{name}" if path else name
        if name not in raw:
            continue  # the dataclass default applies
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, raw[name], key_path)
            continue
        value = _coerce(raw[name], tp, key_path)
        _check_range(value, f.metadata, key_path)
        kwargs[name] = value
    obj = cls(**kwargs)
    _check_cross_field(obj, path)
    return _fill_defaults(obj)


def _check_cross_field(obj, path: str) -> None:
    """Constraints that involve more than one key."""
    if isinstance(obj, TrainParams):
        if not obj.ema_rates:
            raise ParamsError(f"{path}.ema_rates: give at least one EMA rate, e.g. [0.9999]")
        for i, r in enumerate(obj.ema_rates):
            if not 0.0 < r < 1.0:
                raise ParamsError(f"{path}.ema_rates[{i}]: must lie in (0, 1), got {r!r}")
        if len(set(obj.posthoc_ema)) != len(obj.posthoc_ema):
            raise ParamsError(f"{path}.posthoc_ema: a length is listed twice: {obj.posthoc_ema}")
    if isinstance(obj, ModelParams):
        if obj.channel_mult is not None and not obj.channel_mult:
            raise ParamsError(f"{path}.channel_mult: give positive integers, e.g. [1, 2, 2, 2]")
    if isinstance(obj, SuperresParams) and obj.sample_noise_aug > obj.noise_aug:
        raise ParamsError(f"{path}.sample_noise_aug: {obj.sample_noise_aug} is above {path}.noise_aug "
                          f"({obj.noise_aug}), a level the network never saw in training; lower it")
    if isinstance(obj, DiffusionParams):
        if obj.loss_weighting != "none" and obj.loss == "kl":
            raise ParamsError(f"{path}.loss_weighting: {obj.loss_weighting!r} weights the MSE term, which loss 'kl' "
                              "has not (the bound's own weights are its point); use loss: mse or hybrid, or none")
        for key, weighting in _WEIGHTING_KEYS.items():
            if getattr(obj, key) is not None and obj.loss_weighting != weighting:
                raise ParamsError(f"{path}.{key}: only read with loss_weighting: {weighting} (it is "
                                  f"{obj.loss_weighting}); remove it")
    if isinstance(obj, SampleParams) and obj.ema_step and not obj.ema_length:
        raise ParamsError(f"{path}.ema_step: {obj.ema_step} needs {path}.ema_length > 0 (the fixed-rate EMAs are "
                          "kept only at the end; the post-hoc EMA's snapshots along the run); set ema_length, "
                          "e.g. 0.1, or ema_step: 0")
    if isinstance(obj, IntrospectParams) and obj.noise_buckets is not None and obj.noise_bucket_edges:
        raise ParamsError(f"{path}.noise_buckets: {obj.noise_buckets} with {path}.noise_bucket_edges "
                          f"{obj.noise_bucket_edges}, which set the buckets instead; give one of them (null, the "
                          "default, for noise_buckets)")
    if isinstance(obj, SampleParams) and obj.eta and obj.sampler != "ddim":
        raise ParamsError(f"{path}.eta: {obj.eta:g} is DDIM's noise, not used by {obj.sampler}; set eta: 0, or "
                          "sampler: ddim")
    if isinstance(obj, IntrospectParams) and obj.dump_steps and not obj.dump_modules:
        raise ParamsError(f"{path}.dump_steps: nothing is dumped without {path}.dump_modules; name the modules "
                          "to dump, e.g. [\"out\"], or set dump_steps: []")
    if isinstance(obj, Params):
        _check_trained(obj)
        _check_sampling(obj)


def _check_trained(obj: "Params") -> None:
    """The cross-section checks of what `train` reads (a model directory's config.json is held to them too)."""
    ip = obj.introspect
    if obj.train.timestep_sampler == "grad-norm" and (ip.noise_buckets == 0 and not ip.noise_bucket_edges
                                                     or not (ip.every or ip.steps)):
        raise ParamsError("train.timestep_sampler: 'grad-norm' learns from the noise-level buckets, which are "
                          "off (introspect.noise_buckets: 0, or no recorded steps: introspect.every: 0 and "
                          "steps: []); turn them on or pick another sampler")
    if obj.train.cuda_graphs and obj.train.timestep_sampler == "output-grad-norm":
        raise ParamsError("train.cuda_graphs: not with timestep_sampler 'output-grad-norm', whose per-example "
                          "hooks keep their values on the host at every step, outside a graph; use "
                          "'loss-second-moment' (it measured as good a guide) or set cuda_graphs: false")
    if obj.train.cuda_graphs and obj.model.grad_checkpoint:
        raise ParamsError("train.cuda_graphs: not with model.grad_checkpoint, whose recomputation reads the RNG "
                          "state on the host inside the backward; a graph pays where the step is small, "
                          "checkpointing where memory is short: turn one off")
    if obj.train.label_dropout == 1.0 and obj.model.class_cond and not obj.train.import_from:
        # Every label replaced by the null class: the class embeddings never train, and the samples
        # drawn "per class" are one unconditional model's, scored as if conditioned.
        raise ParamsError("train.label_dropout: 1 replaces every label with the null class, so the class "
                          "embeddings of this class-conditional model never train; lower it (0.1 is usual), "
                          "or set model.class_cond: false for an unconditional model")
    # Introspection steps count completed updates, 1..train.steps; a later one would never be recorded.
    for key in ("steps", "dump_steps"):
        for i, st in enumerate(getattr(obj.introspect, key)):
            if st > obj.train.steps:
                raise ParamsError(f"introspect.{key}[{i}]: step {st} is after the last step (train.steps: "
                                  f"{obj.train.steps}); steps count completed updates, 1..train.steps")
    if obj.superres.low_res and obj.superres.low_res >= obj.data.image_size:
        raise ParamsError(f"superres.low_res: {obj.superres.low_res} is not below data.image_size "
                          f"({obj.data.image_size}); give the low-res side, e.g. {obj.data.image_size // 2}")


def _check_sampling(obj: "Params") -> None:
    """The cross-section checks of the sampling params against the training ones."""
    if obj.sample.ema_step:
        check_ema_step(obj.sample.ema_step, obj.train)
    fast = obj.sample.sampler not in ("ddpm", "ddim")
    if obj.sample.thresholding == "dynamic" and not fast:
        raise ParamsError(f"sample.thresholding: 'dynamic' is for the fast solvers; {obj.sample.sampler} "
                          "takes static or none (its clip_denoised)")
    if obj.sample.churn and obj.sample.sampler != "heun":
        raise ParamsError(f"sample.churn: only heun adds churn, not {obj.sample.sampler}; set churn: 0")
    # The respacer itself decides (one rule, not a copy): any string it cannot apply to T steps.
    try:
        space_timesteps(obj.diffusion.timesteps, obj.sample.respacing)
    except ValueError as e:
        raise ParamsError(f"sample.respacing: {e} (with diffusion.timesteps: {obj.diffusion.timesteps})") from None


def snapshot_steps(steps: int, count: int) -> list[int]:
    """The steps after which a run of `steps` steps writes its `count` post-hoc EMA snapshots: evenly
    spaced, the last at the last step (every step where count >= steps)."""
    return sorted({-(-k * steps // count) for k in range(1, count + 1)})


# The losses per t that IDDPM's sampler (and grad-norm's shape within a bucket) keeps before it
# leaves uniform: training/timestep_sampler.py's `history`.
SAMPLER_HISTORY = 10


def levels_measured_at(step: int, ip: "IntrospectParams", *, last: int) -> bool:
    """Whether the noise-level buckets are measured at update `step` (training/recording.py asks
    this): a recorded step (a multiple of `every` if > 0 and the `last`, or in `steps` or
    `dump_steps`) that is also a multiple of `noise_levels_every`, in `steps`, or the last."""
    def on(every, listed):
        return (every > 0 and (step % every == 0 or step == last)) or step in listed
    return on(ip.every, [*ip.steps, *ip.dump_steps]) and on(ip.noise_levels_every, ip.steps)


def check_ema_step(step: int, train: "TrainParams") -> None:
    """`sample.ema_step` must be a step after which the run of `train` wrote snapshots."""
    steps = snapshot_steps(train.steps, train.posthoc_ema_snapshots)
    if step not in steps:
        nearest = [s for s in steps if s < step][-1:] + [s for s in steps if s > step][:1]
        raise ParamsError(f"sample.ema_step: {step} is not a step with post-hoc EMA snapshots (train.steps "
                          f"{train.steps}, train.posthoc_ema_snapshots {train.posthoc_ema_snapshots}: "
                          f"{', '.join(map(str, steps[:3]))}{', ...' if len(steps) > 3 else ''}); the nearest: {' or '.join(map(str, nearest))}, "
                          "or 0 for the last")


# Each weighting's keys and the papers' values that null stands for (Hang et al. 2023; Choi et al. 2022).
_WEIGHTING_KEYS = {"min_snr_gamma": "min_snr", "p2_k": "p2", "p2_gamma": "p2"}
_WEIGHTING_DEFAULTS = {"min_snr_gamma": 5.0, "p2_k": 1.0, "p2_gamma": 1.0}


def _fill_defaults(obj):
    """Writes in the values that a null key stands for, once the keys are checked."""
    if isinstance(obj, DiffusionParams):
        unset = {k: _WEIGHTING_DEFAULTS[k] for k, w in _WEIGHTING_KEYS.items()
                 if w == obj.loss_weighting and getattr(obj, k) is None}
        return dataclasses.replace(obj, **unset) if unset else obj
    return obj


def from_dict(raw: Any) -> Params:
    return _build(Params, raw, "")


# What a model directory's config.json keeps of the params: the sections (or, for superres, the keys)
# that `train` reads. The others are read by the stages after it (sample, evaluate, report): kept in
# the weights' directory they gave two experiments that train the same weights and sample them
# differently two directories, so DVC ran everything downstream of the model again for each, and a
# run-cache restore of train handed back another experiment's sampling params.
TRAINED_SECTIONS = ("data", "model", "diffusion", "train", "introspect", "superres")
SUPERRES_TRAIN_KEYS = ("low_res", "quantise", "noise_aug")  # the others are read by sampling only


def trained_dict(params: Params) -> dict:
    """The params a model was trained with, as config.json stores them (TRAINED_SECTIONS)."""
    d = params.to_dict()
    out = {s: d[s] for s in TRAINED_SECTIONS}
    out["superres"] = {k: d["superres"][k] for k in SUPERRES_TRAIN_KEYS}
    return out


def trained_from_dict(raw: Any) -> Params:
    """The Params of a model directory's config.json: its trained sections checked as params.yaml's
    are, the sampling keys at their defaults and not cross-checked (a model has none of its own:
    the sampling params are the stage's). A config.json written before it kept the trained
    sections alone holds the whole params: the others are dropped as they are read."""
    if not isinstance(raw, dict):
        raise ParamsError(f"params: expected a mapping of keys, got {raw!r}")
    sections = [f.name for f in dataclasses.fields(Params)]
    unknown = sorted(set(raw) - set(sections))
    if unknown:
        raise ParamsError(f"{unknown[0]}: unknown key; allowed keys: {', '.join(sections)}")
    hints = typing.get_type_hints(Params)
    built = {s: _build(hints[s], raw.get(s), s) for s in TRAINED_SECTIONS if s != "superres"}
    superres = raw.get("superres") or {}
    if not isinstance(superres, dict):
        raise ParamsError(f"superres: expected a mapping of keys, got {superres!r}")
    sampling = set(dataclasses.asdict(SuperresParams())) - set(SUPERRES_TRAIN_KEYS)
    kept = {k: v for k, v in superres.items() if k not in sampling}  # an unknown key stays, to be refused
    # Sampling's noise level is not the model's: at 0 it never exceeds the trained noise_aug.
    built["superres"] = _build(SuperresParams, {**kept, "sample_noise_aug": 0.0}, "superres")
    params = Params(**built)
    _check_trained(params)
    return params


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping: PyYAML keeps the last silently, so
    `lr` set twice in `train:` ran with whichever came second (DVC's own parser refuses it, so the
    stages, run alone, must too)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: its keys may be overridden here
                continue
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} is given twice in one section", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load(path: str | Path = "params.yaml") -> Params:
    """Loads and validates params.yaml; raises ParamsError with a one-line message."""
    path = Path(path)
    if not path.exists():
        raise ParamsError(f"{path}: file not found; run from the project root or pass --params PATH")
    try:
        raw = yaml.load(path.read_text(), Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ParamsError(f"{path}:{where} is not valid YAML ({getattr(e, 'problem', e)})") from None
    if raw is None:
        # Refused, not warned about: an emptied file (a bad save, `>` for `>>`) would otherwise train
        # hours of a different experiment on the defaults, and a warning scrolls away in DVC/SLURM logs.
        raise ParamsError(f"{path}: the file is empty (no keys); if that is an accident, restore it "
                          f"(`git checkout -- {path}`); to run on every default, write {{}} in it "
                          "(`ddpmrepro info --defaults` prints them)")
    return from_dict(raw)


def save_resolved(params: Params, path: str | Path, sections: typing.Iterable[str] | None = None,
                  omit: typing.Iterable[str] = ()) -> None:
    """Writes the resolved params (all, or some sections, less the `omit` keys "section.key")
    beside an output."""
    d = params.to_dict()
    if sections is not None:
        d = {s: d[s] for s in sections}
    for key in omit:
        section, name = key.split(".")
        d.get(section, {}).pop(name, None)
    Path(path).write_text(yaml.safe_dump(d, sort_keys=False))


# --- docs/PARAMS.md ---------------------------------------------------------------------------

_TYPE_WORDS = {int: "integer", float: "number", str: "string", bool: "true/false"}


def _doc_type(tp) -> str:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return f"{_doc_type(inner)} or null"
    if typing.get_origin(tp) in (list, typing.List):
        return f"list of {_TYPE_WORDS[typing.get_args(tp)[0]]}s"
    return _TYPE_WORDS[tp]


def _doc_value(v) -> str:
    return "`" + (json.dumps(v) if not isinstance(v, str) else (v or "''")) + "`"


def _doc_allowed(meta: dict, listed: bool) -> str:
    if meta.get("choices") is not None:
        return " \\| ".join(f"`{c}`" for c in meta["choices"])
    lo, hi = meta.get("min"), meta.get("max")
    parts = ([f"{'>' if meta.get('min_exclusive') else '>='} {lo}"] if lo is not None else []) + \
            ([f"<= {hi}"] if hi is not None else [])
    return ("each " if listed and parts else "") + ", ".join(parts)


def markdown(shipped: dict | None = None) -> str:
    """docs/PARAMS.md: every key with its type, default, allowed values and meaning; `shipped` (the
    project's params.yaml, read) marks the keys it sets to another value than their default (a reader
    of this page alone took the default sampler, DDIM, for the pipeline's: found from outside)."""
    shipped = shipped or {}

    def shipped_value(section: str, key: str, default):
        value = (shipped.get(section) or {}).get(key, default)
        return None if value == (list(default) if isinstance(default, tuple) else default) else value

    differing = [f"`{section}.{f.name}: {_doc_value(v).strip('`')}`" for section, cls in typing.get_type_hints(Params).items()
                 for f in dataclasses.fields(cls)
                 if (v := shipped_value(section, f.name, f.default_factory() if f.default is dataclasses.MISSING
                                        else f.default)) is not None]
    out = ["# params.yaml", "",
           "<!-- Generated by `python -m ddpmrepro.params --markdown > docs/PARAMS.md` from the dataclasses in",
           "     src/ddpmrepro/params.py; do not edit by hand (tests/test_params.py checks that it is current). -->",
           "",
           "One section per stage. Every key is optional: a missing key takes its default (`ddpmrepro info",
           "--defaults` prints them all). An unknown key, a wrong type or a value outside what is allowed stops",
           "any stage at load, before it writes anything, with exit code 2 and one line naming the key, e.g.",
           "`Error: params.yaml: train.precision: 'fp8' is not one of fp32 | fp16 | bf16`. An empty file is",
           "refused too (write `{}` to mean every default). Steps count completed optimizer updates everywhere.",
           "One exception under `dvc repro`: a misspelt *section* that dvc.yaml interpolates (`sampel:` for `sample:`)",
           "stops DVC's own parser first, `failed to parse 'stages.sample.meta' ... Could not find 'sample.nproc'`",
           "(nothing runs, nothing is touched); `ddpmrepro check-params` and `snakemake` name the key.",
           "", "Checked across keys:",
           "- `sample.respacing` must respace `diffusion.timesteps` steps (by the very function that respaces);",
           "- `introspect.steps` and `introspect.dump_steps` lie in 1..`train.steps`; `dump_steps` need `dump_modules`;",
           "- `train.ema_rates`: at least one, each in (0, 1); `train.posthoc_ema`: no length twice; "
           "`model.channel_mult`: not empty;",
           "- `sample.thresholding: dynamic` needs a fast solver; `sample.churn` > 0 needs `sampler: heun`; "
           "`sample.eta` > 0 needs `sampler: ddim`;",
           "- `introspect.noise_buckets` or `noise_bucket_edges`, not both;",
           "- `train.label_dropout: 1` only with `model.class_cond: false` (or `train.import_from`): it would "
           "leave the class embeddings untrained;",
           "- `diffusion.min_snr_gamma`, `p2_k`, `p2_gamma` only with their `loss_weighting`, and no weighting with "
           "`loss: kl`.", ""]
    if differing:
        out += ["The default column is what a missing key takes. The project's `params.yaml` sets "
                + ("this key" if len(differing) == 1 else "these keys") + " to another value: "
                + ", ".join(differing) + " (marked in its row).", ""]
    for section, cls in typing.get_type_hints(Params).items():
        out += [f"## {section}", "", " ".join((cls.__doc__ or "").split()), "",
                "| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            listed = "list of" in _doc_type(tp)
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            doc = f.metadata["doc"].replace("|", "\\|")
            if (value := shipped_value(section, f.name, default)) is not None:
                doc += f" **params.yaml: {_doc_value(value)}.**"
            out.append(f"| `{section}.{f.name}` | {_doc_type(tp)} | {_doc_value(default)} | "
                       f"{_doc_allowed(f.metadata, listed)} | {doc} |")
        out.append("")
    return "\n".join(out)


__all__ = [
    "Params", "ParamsError", "DataParams", "ModelParams", "DiffusionParams", "TrainParams",
    "IntrospectParams", "SampleParams", "SuperresParams", "EvaluatorParams", "EvaluateParams", "ReportParams",
    "load", "from_dict", "save_resolved", "markdown", "snapshot_steps", "check_ema_step",
]


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m ddpmrepro.params", description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", required=True, help="print docs/PARAMS.md")
    parser.add_argument("--shipped", default="params.yaml", type=Path,
                        help="the project's params file, whose values other than the defaults are marked")
    args = parser.parse_args()
    print(markdown(yaml.safe_load(args.shipped.read_text()) if args.shipped.is_file() else None), end="")

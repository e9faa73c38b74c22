"""`ddpmrepro`: one thin command per pipeline stage.

Paths are options (their defaults are the paths in dvc.yaml); tunables come from params.yaml.
A user error (bad params, missing or corrupt data, a broken checkpoint) prints one line and
exits non-zero (2 for params.yaml, 1 otherwise) before anything is written.
"""
from __future__ import annotations

import errno
import functools
import logging
import os
import sys
from pathlib import Path

import click

from . import outputs
from . import params as P
from .outputs import OutputKind, replace_refusal

PARAMS_OPTION = click.option("-p", "--params", "params_path", default="params.yaml", show_default=True,
                             type=click.Path(dir_okay=False, path_type=Path), help="The params file to read.")


class ParamsFileError(click.ClickException):
    """A bad params.yaml, or a value that does not fit the data or the model: one line, exit code 2
    (like a usage error), before anything is written."""

    exit_code = 2


def _load_params(path: Path) -> P.Params:
    try:
        return P.load(path)
    except P.ParamsError as e:
        raise ParamsFileError(f"{path}: {e}" if not str(e).startswith(str(path)) else str(e)) from None


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _user_error(e: Exception) -> click.ClickException | None:
    """The one-line error for a user-facing exception; None for a bug, which keeps its traceback."""
    from .files import CheckpointError
    from .data import DataError

    if isinstance(e, P.ParamsError):
        return ParamsFileError(_first_line(e))
    if isinstance(e, OSError) and e.filename is not None and e.strerror:  # e.g. an unwritable output
        names = f"{e.filename} -> {e.filename2}" if e.filename2 is not None else f"{e.filename}"
        return click.ClickException(f"{names}: {e.strerror}")
    if isinstance(e, (DataError, CheckpointError, FloatingPointError, ValueError, RuntimeError, FileNotFoundError)):
        return click.ClickException(_first_line(e))
    return None


def user_errors(fn):
    """Turns the library's user-facing errors into one clear line and a non-zero exit (2 for
    params). In a torchrun worker the line goes to the agent, which prints the first rank's once."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from .runtime.torchrun import report_error

        try:
            return fn(*args, **kwargs)
        except click.ClickException as e:
            error = e
        except Exception as e:
            error = _user_error(e)
            if error is None or os.environ.get("DDPMREPRO_DEBUG"):
                report_error(None, 1)  # a crash (traceback follows): when, for the agent to find the root cause
                raise
        if report_error(error.format_message(), error.exit_code):
            sys.stdout.flush(), sys.stderr.flush()
            os._exit(error.exit_code)  # no interpreter teardown: NCCL would warn about the live process group
        raise error from None
    return wrapper


_WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EROFS)


def writes(**declared: str | OutputKind):
    """Declares a command's output options (parameter name -> "file", "dir" (written into) or the
    OutputKind of a directory replaced whole) and checks, before the command does any work, that
    each can be written, and that replacing a directory destroys nothing but an earlier output of
    its kind: otherwise one line naming the option."""
    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            options = {p.name: p.opts[0] for p in click.get_current_context().command.params}
            for name, kind in declared.items():
                if kwargs[name] is None:  # an optional output not asked for
                    continue
                problem = output_problem(Path(kwargs[name]), kind)
                if problem:
                    raise click.ClickException(f"{options[name]} {kwargs[name]}: {problem}")
            try:
                return fn(*args, **kwargs)
            except OSError as e:
                # A write that fails on an open file (disk full, quota, I/O error) carries no file name.
                if e.filename is not None or e.errno not in _WRITE_ERRNOS:
                    raise
                written = ", ".join(f"{options[name]} {kwargs[name]}" for name in declared if kwargs[name] is not None)
                raise click.ClickException(f"{e.strerror} while writing {written}") from None
        return wrapper
    return decorate


def output_problem(path: Path, kind: str | OutputKind) -> str | None:
    """Why `path` cannot be written as a `kind` output ("dir": a directory written into; an
    OutputKind: a directory replaced whole through a temp sibling, which must be missing, empty or
    of that kind; "file": replaced through a temp sibling), or None.

    Leaves nothing behind: the directory that would receive the writes (the output directory
    itself, else its nearest existing ancestor) is probed by creating and removing a temp file,
    because permission bits say nothing about a read-only mount, and nothing at all to root.
    """
    if isinstance(kind, OutputKind):
        problem = replace_refusal(path, kind)
        if problem:
            return problem
        kind = "dir"
    if path.is_dir():
        return "is a directory; a file path is needed" if kind == "file" else _probe(path)
    if kind == "dir" and (path.exists() or path.is_symlink()):
        return "is a file; a directory is needed"
    parent = next((p for p in path.parents if p.exists()), Path("."))
    if not parent.is_dir():
        return f"{parent} is a file, not a directory"
    return _probe(parent)


def _probe(directory: Path) -> str | None:
    import tempfile

    try:
        fd, name = tempfile.mkstemp(prefix=".ddpmrepro-write-test-", dir=directory)
    except OSError as e:
        return f"cannot create files in {directory} ({e.strerror})"
    os.close(fd)
    os.unlink(name)
    return None


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="ddpmrepro")
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
def main(verbose: bool) -> None:
    """Reproducible class-conditional DDPM/IDDPM with gradient introspection.

    Stages, in pipeline order: check-params, prepare, fit-evaluator, train, sample,
    bits-per-dim, evaluate, report.
    Run them all with `dvc repro` or `snakemake --cores all`; each reads params.yaml.
    """
    from .runtime.torchrun import die_with_agent

    die_with_agent()  # a torchrun worker: first of all (torch takes seconds to import), as workers run outside our group
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(name)s: %(message)s",
                        stream=sys.stderr)


@main.command("check-params")
@PARAMS_OPTION
@click.option("--out", default=None, type=click.Path(file_okay=False, path_type=Path),
              help="Where to write the sections resolved [default: reports/params for ./params.yaml, nowhere for "
                   "another file: reports/params is the pipeline's, a DVC output].")
@click.option("--data", "data_dir", default="data/prepared", show_default=True,
              type=click.Path(file_okay=False, path_type=Path),
              help="The prepared data train will read: its manifest, where prepare made it from these params, "
                   "checks train.batch_per_proc against the data.")
def check_params(params_path: Path, out: Path | None, data_dir: Path) -> None:
    """Validate params.yaml, and the stages against each other; write every section resolved.

    \b
    Reads:  the whole params file; DATA/manifest.json where it is there; data.root as prepare
            lists it (no image opened; skipped where data.root is absent and DATA was prepared
            from these params).
    Writes: OUT/<section>.yaml for each section whose resolved values changed.
    The pipeline's first stage: DVC runs it before any other stage removes its outputs, so
    whatever a later stage would refuse of these params alone is refused here (check_pipeline).
    """
    from .pipeline.check_params import check_base_pipeline, check_data_source, check_pipeline, write_resolved

    params = _load_params(params_path)
    pipelines_file = Path(params_path).resolve() == Path("params.yaml").resolve()
    if out is None and pipelines_file:
        out = Path("reports/params")
    try:
        if pipelines_file:  # dvc.yaml's (another file, e.g. cascade/upsampler.yaml, is checked as itself)
            check_base_pipeline(params)
        check_pipeline(params, data_dir, checked=out)
        check_data_source(params, data_dir)
    except P.ParamsError as e:
        raise ParamsFileError(f"{params_path}: {e}") from None
    if out is None:  # another file's sections would overwrite the pipeline's (found from outside)
        click.echo(f"{params_path} is valid (its resolved sections are written with --out DIR)")
        return
    try:  # not @user_errors: that imports torch, seconds for a stage that runs on every params edit
        written = write_resolved(params, out)
    except OSError as e:
        raise click.ClickException(f"{e.filename or out}: cannot write ({e.strerror})") from None
    click.echo(f"{params_path} is valid; {len(written)} resolved section file(s) updated in {out}")


@main.command()
@PARAMS_OPTION
@click.option("--out", default="data/prepared", show_default=True, type=click.Path(path_type=Path))
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Image-folder decode processes [default: the CPUs this job may use]; never changes the output.")
@user_errors
@writes(out=outputs.PREPARED)
def prepare(params_path: Path, out: Path, workers: int | None) -> None:
    """Turn the dataset into the versioned training format.

    \b
    Reads:  params `data.*`; the source files under data.root (none for digits).
    Writes: OUT/<split>-<k>.images.npy, OUT/<split>-<k>.labels.npy (shards of ~128 MiB of uint8
            images and their int64 labels), OUT/manifest.json (class names, counts, sha256 of
            each shard, the data params used).
    """
    from .data import prepare as run

    manifest = run(_load_params(params_path).data, out, workers=workers)
    counts = manifest["counts"]
    click.echo(f"prepared {manifest['source']}: {sum(counts['train'])} train / {sum(counts['test'])} test images, "
               f"{manifest['num_classes']} classes -> {out}")


@main.command("fit-evaluator")
@PARAMS_OPTION
@click.option("--data", "data_dir", default="data/prepared", show_default=True, type=click.Path(path_type=Path))
@click.option("--out", default="models/evaluator", show_default=True, type=click.Path(path_type=Path))
@user_errors
@writes(out=outputs.EVALUATOR)
def fit_evaluator(params_path: Path, data_dir: Path, out: Path) -> None:
    """Train the evaluator classifier on the real training split.

    \b
    Reads:  params `evaluator.*`; DATA (prepared arrays).
    Writes: OUT/model.safetensors, OUT/config.json, OUT/metrics.json (its test accuracy).
    """
    from .data import load_prepared
    from .evaluation.evaluator import fit_evaluator as run

    params = _load_params(params_path)
    d = load_prepared(data_dir)
    _claim_cpus()
    m = run(d.train_images, d.train_labels, d.test_images, d.test_labels, params.evaluator, out,
            num_classes=d.manifest["num_classes"], class_names=d.manifest["class_names"])
    click.echo(f"evaluator test accuracy {m['test_accuracy']:.4f} -> {out}")


@main.command()
@PARAMS_OPTION
@click.option("--data", "data_dir", default="data/prepared", show_default=True, type=click.Path(path_type=Path))
@click.option("--out", default="models/ddpm", show_default=True, type=click.Path(path_type=Path),
              help="Final weights (safetensors) and config.json.")
@click.option("--live", "live_dir", default="reports/train/live", show_default=True, type=click.Path(path_type=Path))
@click.option("--introspect", "introspect_dir", default="reports/introspect", show_default=True,
              type=click.Path(path_type=Path))
@click.option("--checkpoints", "checkpoint_root", default="checkpoints", show_default=True,
              type=click.Path(path_type=Path), callback=lambda ctx, param, value: _checkpoint_root(value),
              help="Resumable state (not a DVC output).")
@click.option("--nproc", type=click.IntRange(min=1), default=None,
              help="Processes (GPUs) per node; overrides train.nproc.")
@click.option("--restart", is_flag=True, help="Ignore existing checkpoints of this run and start from step 0.")
@click.option("--max-restarts", type=click.IntRange(min=0), default=None,
              help="Under torchrun: restart all ranks this often after one fails; overrides train.max_restarts.")
@click.option("--nnodes", type=click.IntRange(min=1), default=None,
              help="Nodes; overrides train.nodes. Without SLURM, run this on each node with --node-rank, --rdzv.")
@click.option("--node-rank", type=click.IntRange(min=0), default=None, help="This node's rank, 0 to NNODES-1.")
@click.option("--rdzv", default=None, metavar="HOST:PORT", help="Node 0's address and a free port on it.")
@user_errors
@writes(out=outputs.MODEL, live_dir=outputs.TRAIN_LOG, introspect_dir=outputs.INTROSPECTION, checkpoint_root="dir")
def train(params_path: Path, data_dir: Path, out: Path, live_dir: Path, introspect_dir: Path,
          checkpoint_root: Path, nproc: int | None, restart: bool, max_restarts: int | None, nnodes: int | None,
          node_rank: int | None, rdzv: str | None) -> None:
    """Train the conditional UNet (torchrun DDP when nproc > 1).

    \b
    Reads:  params `data.*`, `model.*`, `diffusion.*`, `train.*`, `introspect.*`; DATA.
    Writes: OUT/{model,ema_<rate>}.safetensors + config.json, phema/ (post-hoc EMA
            snapshots), SHA256SUMS; LIVE (dvclive metrics and per-step plots); INTROSPECT
            (gradient tables, SHA256SUMS); CHECKPOINTS/<run-hash>/ (resumable).
    Resumes from the last checkpoint of the same run (params, data and code); Ctrl-C or
    SIGTERM saves a checkpoint at the next step boundary; after a rank fails, torchrun
    restarts the group from that checkpoint (up to train.max_restarts times).
    """
    from .runtime import distributed as D
    from .runtime import launch

    params = _load_params(params_path)
    if params.train.import_from:  # a published model: imported, not trained (docs/MODELS.md)
        from .interop.convert import use_published

        config = use_published(params, data_dir, out, live_dir, introspect_dir)
        click.echo(f"training skipped: imported {params.train.import_from} (sha256 "
                   f"{config['source']['sha256'][:12]}) -> {out}")
        return
    given = f"--nnodes {nnodes}" if nnodes else f"train.nodes={params.train.nodes}"
    nnodes = nnodes or params.train.nodes
    if (nnodes > 1 and not D.in_launch() and not launch.in_slurm_job(os.environ)
            and (node_rank is None or node_rank >= nnodes or not rdzv)):  # on SLURM, the allocation's nodes
        raise click.UsageError(f"{given} needs --node-rank K (0 to {nnodes - 1}, a different one on each "
                               "node) and --rdzv HOST:PORT (node 0's address and a free port), or a SLURM allocation "
                               f"of {nnodes} nodes")
    if nnodes == 1 and not D.in_launch() and ((node_rank or 0) > 0 or rdzv):  # ignored: found from outside
        given_flags = " and ".join(f for f, v in (("--node-rank", node_rank), ("--rdzv", rdzv)) if v)
        raise click.UsageError(f"{given_flags}: for a training on several nodes, but {given}; "
                               "leave them out, or pass --nnodes N")
    code = launch.launch_train(params.train.device, nproc or params.train.nproc, sys.argv[1:], nnodes=nnodes,
                               node_rank=node_rank, rdzv=rdzv, precision=params.train.precision,
                               max_restarts=params.train.max_restarts if max_restarts is None else max_restarts)
    if code is not None:  # the launcher ran the training in its workers
        raise SystemExit(code)
    from .training.loop import TrainPaths
    from .training.loop import train as run

    summary = run(params, TrainPaths(data_dir, out, live_dir, introspect_dir, checkpoint_root), restart=restart)
    # RANK, not D.is_main(): the process group is gone by now, and every rank would say it is rank 0.
    if summary and os.environ.get("RANK", "0") == "0":
        click.echo(f"trained {summary['step']} steps, final loss {summary['loss']:.4f} -> {out}")


def _checkpoint_root(root: Path) -> Path:
    """--checkpoints as train uses it (before `writes` checks it): inside a DVC experiment's temporary
    clone, a relative root is the project's (files.project_root_for)."""
    from .runtime import distributed as D
    from .files import project_root_for

    shared = project_root_for(root)
    if shared != root and not D.in_launch():  # said once, by the launcher
        click.echo(f"checkpoints go to {shared}: the project's, as this is a DVC experiment's temporary copy, "
                   "which DVC deletes when the experiment ends", err=True)
    return shared


def _claim_cpus(nproc: int = 1) -> None:
    """Runs torch on this job's share of the cores, waiting while concurrent jobs hold them (cpu_slots)."""
    from .runtime import cpu_slots

    cpu_slots.claim(nproc)


@main.command()
@PARAMS_OPTION
@click.option("--model", "model_dir", default="models/ddpm", show_default=True, type=click.Path(path_type=Path))
@click.option("--out", default="samples", show_default=True, type=click.Path(path_type=Path))
@click.option("--nproc", type=click.IntRange(min=1), default=None, help="Overrides sample.nproc.")
@user_errors
@writes(out=outputs.SAMPLES)
def sample(params_path: Path, model_dir: Path, out: Path, nproc: int | None) -> None:
    """Generate sample.per_class images per class from the EMA weights.

    \b
    Reads:  params `sample.*`; MODEL (weights + config.json).
    Writes: OUT/samples.npz (uint8 images, labels, seeds), OUT/grid.png (one row per class).
    Image k depends only on (sample.seed, k): not on batch size or process count.
    """
    from .runtime import distributed as D
    from .evaluation.sample import sample as run
    from .model_dir import require_config
    from .runtime import launch

    params = _load_params(params_path)
    code = launch.launch_sample(nproc or params.sample.nproc, sys.argv[1:], params.sample.precision,
                                check_first=lambda: require_config(model_dir))
    if code is not None:  # the launcher ran the sampling in its workers
        raise SystemExit(code)
    path = run(params, model_dir, out)
    if D.is_main():
        click.echo(f"wrote {path}")


@main.command()
@PARAMS_OPTION
@click.option("--samples", "samples_dir", default="samples", show_default=True, type=click.Path(path_type=Path))
@click.option("--data", "data_dir", default="data/prepared", show_default=True, type=click.Path(path_type=Path))
@click.option("--evaluator", "evaluator_dir", default="models/evaluator", show_default=True,
              type=click.Path(path_type=Path))
@click.option("--model", "model_dir", default="models/ddpm", show_default=True, type=click.Path(path_type=Path))
@click.option("--out", default="metrics.json", show_default=True, type=click.Path(dir_okay=False, path_type=Path),
              help="The headline metrics (the columns of `dvc exp show`).")
@click.option("--detail", "detail_out", default="reports/metrics_detail.json", show_default=True,
              type=click.Path(dir_okay=False, path_type=Path),
              help="Every metric: KID, IS, per class, every floor value, Inception, the training summary.")
@click.option("--live", "live_dir", default="reports/train/live", show_default=True, type=click.Path(path_type=Path),
              help="The training run's dvclive files (the final loss is copied to OUT, every last value to DETAIL).")
@click.option("--table", "table_out", default=None, type=click.Path(dir_okay=False, path_type=Path),
              help="Also write the headline and per-class values as an HTML table (for `snakemake --report`).")
@click.option("--bpd", "bpd_path", default=None, type=click.Path(dir_okay=False, path_type=Path),
              help="The test bits/dim `ddpmrepro bits-per-dim` wrote (the pipeline's way: MODEL is then not "
                   "read); without it, computed here from MODEL.")
@user_errors
@writes(out="file", detail_out="file", table_out="file")
def evaluate(params_path: Path, samples_dir: Path, data_dir: Path, evaluator_dir: Path, model_dir: Path,
             out: Path, detail_out: Path, live_dir: Path, table_out: Path | None, bpd_path: Path | None) -> None:
    """Score the samples: class accuracy, FID/KID/precision/recall (global and per class,
    with a real-vs-real floor), optional Inception metrics, test bits/dim.

    \b
    Reads:  params `evaluate.*` (and, for bits/dim, `sample.ema_rate`, `ema_length`, `ema_step`); SAMPLES, DATA,
            EVALUATOR, BPD or else MODEL, LIVE/metrics.json.
    Writes: OUT (the headline metrics, flat keys), DETAIL (all of them), TABLE; see docs/METRICS.md.
    """
    from .evaluation.evaluate import evaluate as run

    params = _load_params(params_path)
    _claim_cpus()
    metrics = run(params, samples_dir, data_dir, evaluator_dir, model_dir, out, detail_out, live_dir, table_out,
                  bpd_path=bpd_path)
    click.echo(" ".join(f"{k}={v:.4g}" if v is not None else f"{k}=n/a" for k, v in metrics.items())
               + f" -> {out}, {detail_out}")


@main.command("bits-per-dim")
@PARAMS_OPTION
@click.option("--data", "data_dir", default="data/prepared", show_default=True, type=click.Path(path_type=Path))
@click.option("--model", "model_dir", default="models/ddpm", show_default=True, type=click.Path(path_type=Path))
@click.option("--out", default="reports/bpd.json", show_default=True, type=click.Path(dir_okay=False, path_type=Path))
@user_errors
@writes(out="file")
def bits_per_dim(params_path: Path, data_dir: Path, model_dir: Path, out: Path) -> None:
    """Test bits/dim of the weights `sample` draws from (the full variational bound: T network
    passes per image), for `evaluate --bpd`.

    \b
    Reads:  params `evaluate.bpd_images`, `sample.ema_rate`, `sample.ema_length`, `sample.ema_step`; DATA, MODEL.
    Writes: OUT: {"bpd", "images", "weights"} (bpd null where evaluate.bpd_images is 0).
    """
    from .evaluation import bits_per_dim as bpd

    params = _load_params(params_path)
    _claim_cpus()
    result = bpd.bits_per_dim(params, data_dir, model_dir)
    bpd.write(result, out)
    value = "n/a (evaluate.bpd_images: 0)" if result["bpd"] is None else f"{result['bpd']:.4g}"
    click.echo(f"bpd={value} on {result['images']} test images -> {out}")


@main.command("sample-superres")
@PARAMS_OPTION
@click.option("--model", "model_dir", default="models/superres", show_default=True, type=click.Path(path_type=Path),
              help="A trained upsampler (superres.low_res > 0 when it was trained).")
@click.option("--data", "data_dir", default=None, type=click.Path(path_type=Path),
              help="The prepared high-res data, for superres.low_res_from: test.")
@click.option("--low-res-from", default=None, help="Overrides superres.low_res_from: 'test' or a base run's samples.npz.")
@click.option("--out", default="samples_superres", show_default=True, type=click.Path(path_type=Path))
@user_errors
@writes(out=outputs.SAMPLES)
def sample_superres(params_path: Path, model_dir: Path, data_dir: Path | None, low_res_from: str | None,
                    out: Path) -> None:
    """Upsample low-res images with a trained super-resolution model (one process).

    \b
    Reads:  params `sample.*`, `superres.sample_noise_aug`, `superres.project`, `superres.low_res_from`
            (test split or a base run's samples.npz: the cascade); MODEL; DATA (for `test`).
    Writes: OUT/samples.npz (images, labels, seeds, low_res, source_index, from_test), OUT/grid.png.
    """
    import dataclasses

    from .evaluation.superres import sample_superres as run
    from .model_dir import require_config
    from .runtime import launch

    params = _load_params(params_path)
    # One process, launched as `sample` is: its share of the cores (cpu_slots) or a GPU (found from
    # outside: it ran beside a training that held every core), a wrong --model said before that.
    launch.launch_sample(1, sys.argv[1:], params.sample.precision, check_first=lambda: require_config(model_dir))
    if low_res_from is not None:  # one params file serves the test-split and the cascade stages
        params = dataclasses.replace(params, superres=dataclasses.replace(params.superres, low_res_from=low_res_from))
    path = run(params, model_dir, out, data_dir)
    click.echo(f"wrote {path}")


@main.command("evaluate-superres")
@PARAMS_OPTION
@click.option("--samples", "samples_dir", default="samples_superres", show_default=True,
              type=click.Path(path_type=Path))
@click.option("--data", "data_dir", default="data/prepared", show_default=True, type=click.Path(path_type=Path))
@click.option("--evaluator", "evaluator_dir", default="models/evaluator", show_default=True,
              type=click.Path(path_type=Path))
@click.option("--out", default="metrics_superres.json", show_default=True,
              type=click.Path(dir_okay=False, path_type=Path), help="Headline: model and bicubic side by side.")
@click.option("--detail", "detail_out", default="reports/metrics_superres_detail.json", show_default=True,
              type=click.Path(dir_okay=False, path_type=Path))
@user_errors
@writes(out="file", detail_out="file")
def evaluate_superres(params_path: Path, samples_dir: Path, data_dir: Path, evaluator_dir: Path, out: Path,
                      detail_out: Path) -> None:
    """Score upsampled images beside bicubic upsampling of the same inputs.

    \b
    Reads:  params `evaluate.pr_neighbourhood`; SAMPLES (from sample-superres), DATA (high-res), EVALUATOR.
    Writes: OUT (sr_* and bicubic_*: PSNR, SSIM for test inputs, FID, precision, recall, consistency),
            DETAIL (every value of both); see docs/SUPERRES.md.
    """
    from .evaluation.superres import evaluate_superres as run

    params = _load_params(params_path)
    _claim_cpus()
    metrics = run(params, samples_dir, data_dir, evaluator_dir, out, detail_out)
    click.echo(" ".join(f"{k}={v:.4g}" for k, v in metrics.items() if v is not None) + f" -> {out}, {detail_out}")


@main.command()
@PARAMS_OPTION
@click.option("--introspect", "introspect_dir", default="reports/introspect", show_default=True,
              type=click.Path(path_type=Path))
@click.option("--live", "live_dir", default="reports/train/live", show_default=True, type=click.Path(path_type=Path))
@click.option("--out", default="reports/figures", show_default=True, type=click.Path(path_type=Path))
@user_errors
@writes(out=outputs.FIGURES)
def report(params_path: Path, introspect_dir: Path, live_dir: Path, out: Path) -> None:
    """Draw the gradient and training figures.

    \b
    Reads:  params `report.*`, `train.import_from`; INTROSPECT tables, LIVE metrics.
    Writes: OUT/*.png (grad-norm heatmaps for parameters and activations, top-k layer
            lines, total norm vs clip threshold, each noise level's share of the update
            and their conflicts, the gradient noise scale, loss curves).
    Fails, writing nothing, when INTROSPECT or LIVE is missing or holds no rows, or when
    INTROSPECT's files differ from its SHA256SUMS. Under train.import_from (an imported
    model) writes only OUT/IMPORTED.txt: nothing was trained.
    """
    from .evaluation.report import make_report

    params = _load_params(params_path)
    paths = make_report(introspect_dir, live_dir, out, params.report, imported_from=params.train.import_from)
    if params.train.import_from:
        click.echo(f"no training figures: the model is imported from {params.train.import_from} -> {out}/IMPORTED.txt")
    else:
        click.echo(f"wrote {len(paths)} figures -> {out}")


@main.command("import")
@PARAMS_OPTION
@click.argument("src", type=click.Path(path_type=Path))
@click.option("--format", "fmt", required=True, type=click.Choice(["improved-diffusion", "guided-diffusion", "diffusers"]),
              help="improved-/guided-diffusion: a UNetModel .pt state dict; diffusers: a UNet2DModel (or pipeline) folder.")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="The model directory to write, e.g. models/NAME.")
@click.option("--data", "data_dir", default="data/prepared", show_default=True, type=click.Path(path_type=Path),
              help="Prepared data the model is for (image size, channels, classes).")
@click.option("--ema-rate", type=click.FloatRange(0, 1, max_open=True), default=None,
              help="The EMA the weights are (0: raw weights). Default: sample.ema_rate.")
@click.option("--attention-order", type=click.Choice(["legacy", "new"]), default="legacy", show_default=True,
              help="guided-diffusion's use_new_attention_order (new); improved-diffusion is legacy.")
@user_errors
@writes(out=outputs.MODEL)
def import_(params_path: Path, src: Path, fmt: str, out: Path, data_dir: Path, ema_rate: float | None,
            attention_order: str) -> None:
    """Convert a published model into the directory `train` writes (docs/MODELS.md).

    \b
    Reads:  SRC; params `model.*`/`diffusion.*` (for .pt files, which hold only tensors; a
            diffusers folder's config.json and scheduler_config.json set them), `superres.low_res`
            (> 0 for an improved-/guided-diffusion SuperResModel file); DATA's manifest.
    Writes: OUT/ema_<rate>.safetensors (or model.safetensors) + config.json (resolved params,
            source file and its sha256); `sample` and `evaluate` read it as a trained model.
    Fails, writing nothing, on a file of another architecture, a truncated file, missing or
    unexpected keys, a shape mismatch, or a pickle that would run code.
    """
    from .interop.convert import import_model

    config = import_model(src, fmt, out, _load_params(params_path), data_dir, ema_rate, attention_order)
    click.echo(f"imported {src} (sha256 {config['source']['sha256'][:12]}) -> {out}")


@main.command("export")
@PARAMS_OPTION
@click.option("--format", "fmt", required=True, type=click.Choice(["diffusers"]))
@click.option("--model", "model_dir", default="models/ddpm", show_default=True, type=click.Path(path_type=Path))
@click.option("--out", required=True, type=click.Path(path_type=Path), help="The folder to write.")
@user_errors
@writes(out=outputs.DIFFUSERS)
def export(params_path: Path, fmt: str, model_dir: Path, out: Path) -> None:
    """Write a trained (or imported) model as a diffusers pipeline folder.

    \b
    Reads:  params `sample.ema_rate`, `sample.ema_length`, `sample.ema_step`; MODEL.
    Writes: OUT/unet/ (UNet2DModel config.json + safetensors), OUT/scheduler/scheduler_config.json
            (DDPMScheduler), OUT/model_index.json (DDPMPipeline), OUT/ddpmrepro.json (null label).
    """
    from .interop.convert import export_diffusers

    sample = _load_params(params_path).sample
    export_diffusers(model_dir, out, sample.ema_rate, sample.ema_length, sample.ema_step)
    click.echo(f"exported {model_dir} -> {out}")


@main.command()
@PARAMS_OPTION
@click.option("--presets", is_flag=True,
              help="List the model presets with their parameter counts for the data of --params.")
@click.option("--defaults", is_flag=True, help="Print every params key at its default value (YAML).")
def info(params_path: Path, presets: bool, defaults: bool) -> None:
    """Print versions, devices and the resolved params.

    \b
    --presets counts parameters for the image shape and variance of --params (the default
    params.yaml: 1x8x8 digits); `-p configs/ddpm-cifar10.yaml` gives CIFAR-10's 3x32x32.
    """
    import torch
    import yaml

    from . import __version__

    if defaults:
        click.echo(yaml.safe_dump(P.Params().to_dict(), sort_keys=False), nl=False)
        return
    click.echo(f"ddpmrepro {__version__}, torch {torch.__version__}, cuda devices: {torch.cuda.device_count()}")
    params = _load_params(params_path)
    if presets:
        _print_presets(params, params_path)
        return
    click.echo(yaml.safe_dump(params.to_dict(), sort_keys=False))


def _print_presets(params: P.Params, params_path: Path) -> None:
    from .model.unet import PRESETS, count_parameters

    d, learn_sigma = params.data, params.diffusion.variance == "learned_range"
    # Every built-in source has 10 classes; an image folder's count is known only after prepare.
    classes = "10 classes" + (" (assumed: image_folder's count is known after prepare)"
                              if d.source == "image_folder" else "")
    click.echo(f"Parameters for the data of {params_path}: {d.channels}x{d.image_size}x{d.image_size} images, "
               f"{classes} + the null label, {'learned' if learn_sigma else 'fixed'} variance "
               f"(diffusion.variance: {params.diffusion.variance}):")

    def count(model_params: P.ModelParams) -> int:
        return count_parameters(model_params, image_size=d.image_size, in_channels=d.channels, num_classes=10,
                                learn_sigma=learn_sigma)

    for name, kw in PRESETS.items():
        arch = " ".join(f"{k}={v}" for k, v in kw.items())
        click.echo(f"  {name:<14} {count(P.ModelParams(preset=name)):>12,}  {arch}")
    m = params.model
    overrides = " with " + " ".join(f"{k}={v}" for k, v in m.overrides().items()) if m.overrides() else ""
    click.echo(f"{params_path} trains {m.preset}{overrides}: {count(m):,} parameters")


if __name__ == "__main__":
    main()

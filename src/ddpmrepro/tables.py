"""The introspection tables' format: their fixed schemas, the chunked parquet writer, the reader.

Training writes these tables (`training/introspect.py` records the rows, `training/loop.py` hands
them to a `TableWriter` on rank 0) and the report stage reads them (`evaluation/report.py`). The
format is shared by both, so it lives here, below both: the report reads with the schema that
wrote, without importing the training code (nor rerunning, under DVC, when that code changes).
pyarrow, and files.py's atomic writes (safetensors for the gradient dumps).

See docs/INTROSPECTION.md for the semantics of every column.
"""
from __future__ import annotations

import math
import os
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from . import files

# --- schemas ----------------------------------------------------------------------------------

PARAM_GRADS_SCHEMA = pa.schema([
    ("step", pa.int64()),
    ("name", pa.string()),          # parameter name as in model.named_parameters()
    ("shape", pa.string()),         # "64x32x3x3"; "" for a 0-d parameter
    ("numel", pa.int64()),
    ("grad_norm", pa.float64()),    # ||p.grad||_2 after all-reduce and unscale, before clipping; NaN if grad is None
    ("param_norm", pa.float64()),   # ||p||_2 before the optimizer step
    ("update_ratio", pa.float64()), # ||p_after - p_before||_2 / ||p_before||_2; NaN if not measured
])
STEPS_SCHEMA = pa.schema([
    ("step", pa.int64()),
    ("total_grad_norm", pa.float64()),     # global norm over all parameters, as given by the loop
    ("selected_grad_norm", pa.float64()),  # norm over the recorded parameters only
    ("clip_threshold", pa.float64()),      # NaN or 0 when clipping is off
    ("clipped", pa.bool_()),
    ("skipped", pa.bool_()),               # optimizer step skipped (non-finite grads under GradScaler)
    ("loss_scale", pa.float64()),          # 1.0 without GradScaler
    ("lr", pa.float64()),
    ("gns_g2", pa.float64()),              # this step's unbiased |G|² estimate (training/noise_scale.py); NaN: none
    ("gns_trace", pa.float64()),           # this step's unbiased tr(Σ) estimate (per-example gradient noise)
])
ACT_GRADS_SCHEMA = pa.schema([
    ("step", pa.int64()),
    ("module", pa.string()),
    ("tensor", pa.string()),        # "output" | "input" (first positional tensor argument)
    ("reduction", pa.string()),     # "global" | "per_rank" | "local" (see ActivationGradRecorder)
    ("rank", pa.int32()),           # -1 for "global", else the rank the numbers come from
    ("world_size", pa.int32()),
    ("calls", pa.int32()),          # gradients received: microbatches x calls per forward (x ranks if global)
    ("numel", pa.int64()),          # elements over all those gradients
    ("l2", pa.float64()),           # of the concatenation of all those gradients
    ("mean", pa.float64()),
    ("std", pa.float64()),          # population std
    ("absmax", pa.float64()),
    ("zero_frac", pa.float64()),
    ("hist", pa.list_(pa.int64())), # counts of log10|g| in histogram_bins equal bins on [hist_lo, hist_hi]; [] if off
    ("hist_lo", pa.float64()),
    ("hist_hi", pa.float64()),
])
NOISE_LEVELS_SCHEMA = pa.schema([     # training/noise_levels.py: one row per (step, noise-level bucket)
    ("step", pa.int64()),
    ("bucket", pa.int32()),         # 0 = the least noisy
    ("space", pa.string()),         # "t" | "logsnr": the units of lo and hi
    ("lo", pa.float64()),           # the bucket's edges ([lo, hi) in t; in log-SNR, lo < hi too)
    ("hi", pa.float64()),
    ("examples", pa.int64()),       # examples of the step's global batch in the bucket
    ("grad_norm", pa.float64()),    # |G_b|: the bucket's part of the step's gradient (they sum to G)
    ("share", pa.float64()),        # <G_b, G> / |G|²: the parts of the update; they sum to 1
    ("cos", pa.list_(pa.float64())),  # cosine of G_b with each bucket's G_c (the conflict matrix's row b)
    ("g2", pa.float64()),           # |mean gradient of the bucket|², unbiased (two halves of the bucket)
    ("trace", pa.float64()),        # tr(Σ) of the bucket's per-example gradients, unbiased
    ("b_simple", pa.float64()),     # trace / g2; NaN when g2 <= 0 (the noise hides the bucket's signal)
])
LOSS_WEIGHT_SCHEMA = pa.schema([      # training/learned_weighting.py: one row per (log step, t) on a grid of t
    ("step", pa.int64()),
    ("t", pa.int64()),              # the timestep (index of the trained process)
    ("logsnr", pa.float64()),       # log(alpha_bar_t / (1 - alpha_bar_t))
    ("u", pa.float64()),            # the learned log of the level's typical MSE: the loss is mse / exp(u) + u
])
SCHEMAS = {"param_grads": PARAM_GRADS_SCHEMA, "steps": STEPS_SCHEMA, "act_grads": ACT_GRADS_SCHEMA,
           "noise_levels": NOISE_LEVELS_SCHEMA, "loss_weight": LOSS_WEIGHT_SCHEMA}
TSV_COLUMNS = ("step", "total_grad_norm", "clip_threshold", "clipped", "skipped", "loss_scale", "lr", "gns_g2",
               "gns_trace")


# --- tables -----------------------------------------------------------------------------------

_PART = re.compile(r"part-(\d{9})-(\d{9})\.parquet")


class TableWriter:
    """Fixed-schema parquet tables under `out_dir`, one directory per table, one file per chunk.

    Layout: `param_grads/`, `steps/`, `act_grads/`, `noise_levels/`, `loss_weight/` hold `part-<first step>-<last step>.parquet`
    (read a whole table with `pandas.read_parquet(out_dir / "param_grads")`); `steps.tsv` is the
    per-step summary for `dvc plots`; `dumps/step-<step>.safetensors` the full-gradient dumps.
    Construct it on rank 0 only. Steps count completed updates (1 = the first). `start_step` is
    the step of the checkpoint this process resumes from (0 for a fresh start): everything
    recorded for later steps (by a run that crashed after its last checkpoint, or by an earlier
    run when start_step is 0) is removed, so no step appears twice; rows up to and including
    `start_step` belong to the checkpoint and are kept.

    Chunks end where `flush_every` steps or `max_rows` rows say, never at a checkpoint: before one,
    `snapshot()` writes the buffered rows (the checkpoint needs them on disk) and keeps them
    buffered; the next flush writes them again in its chunk and removes the snapshot's files, and a
    run resumed from that checkpoint reads them back first (`unflushed_from`, saved in it). So the
    files do not depend on checkpoint_every, nor on a stop and resume: they equal, not only their
    rows (found from outside: a resumed run's reports/introspect had another md5 in dvc.lock).
    """

    def __init__(self, out_dir: str | Path, *, start_step: int, flush_every: int = 250, max_rows: int = 10_000,
                 unflushed_from: int | None = None):
        self.out_dir = Path(out_dir)
        self.flush_every = flush_every
        # A row budget as well as a step budget: recording every step buffers ~200 rows a step, and
        # thousands of small Arrow tables held until a 250-step flush grew the process by ~50 MB
        # (allocator pages, not rows: the buffer itself was < 5 MB). Flushing at 10k rows kept the
        # peak growth under 20 MB (benchmarks/introspect_overhead.py); files stay ~100 KB or more.
        self.max_rows = max_rows
        self._rows = 0
        self._buf: dict[str, list[pa.Table]] = {t: [] for t in SCHEMAS}  # arrow, not dicts: ~50x smaller
        self._tsv_buf: list[str] = []
        first = start_step + 1  # the first step this process records
        self._last_flush = first  # first step not yet flushed
        self._last_step = start_step
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._truncate(first)
        self._snapshot: list[Path] = []  # the last snapshot's files, rows still buffered: the next chunk replaces them
        if unflushed_from is not None and unflushed_from < first:
            self._read_back(unflushed_from)

    @property
    def unflushed_from(self) -> int:
        """The first step whose rows an uninterrupted run would not have written yet (for the checkpoint)."""
        return self._last_flush

    def _read_back(self, from_step: int) -> None:
        """Into the buffer: the rows of steps >= from_step, the checkpoint's snapshot."""
        for table, schema in SCHEMAS.items():
            for f in sorted((self.out_dir / table).iterdir()):
                m = _PART.fullmatch(f.name)
                if m and int(m[1]) >= from_step:
                    t = pq.read_table(f, schema=schema)
                    self._buf[table].append(t)
                    self._rows += t.num_rows
                    self._snapshot.append(f)
        self._last_flush = from_step

    def _truncate(self, from_step: int) -> None:
        """Removes every row, TSV line and dump of a step >= from_step."""
        for table, schema in SCHEMAS.items():
            d = self.out_dir / table
            d.mkdir(exist_ok=True)
            for f in sorted(d.iterdir()):
                m = _PART.fullmatch(f.name)
                if not m:  # a temp file left by a crash
                    if f.name.startswith("."):
                        f.unlink()
                    continue
                first, last = int(m[1]), int(m[2])
                if first >= from_step:
                    f.unlink()
                elif last >= from_step:
                    t = pq.read_table(f, schema=schema)
                    t = t.filter(pc.less(t["step"], from_step))
                    steps = t["step"].to_pylist()
                    self._write_part(table, t, min(steps), max(steps))
                    f.unlink()
        tsv = self.out_dir / "steps.tsv"
        keep = ["\t".join(TSV_COLUMNS) + "\n"]
        if tsv.exists():
            for ln in tsv.read_text().splitlines(keepends=True)[1:]:
                fields = ln.rstrip("\n").split("\t")
                if ln.endswith("\n") and len(fields) == len(TSV_COLUMNS) and int(fields[0]) < from_step:
                    keep.append(ln)  # (a line cut short by a crash is dropped)
        files.atomic_write_text(tsv, "".join(keep))
        dumps = self.out_dir / "dumps"
        if dumps.exists():
            for f in dumps.glob("step-*.safetensors"):
                if int(f.stem.split("-")[1]) >= from_step:
                    f.unlink()

    def _write_part(self, table: str, t: pa.Table, first: int, last: int) -> None:
        path = self.out_dir / table / f"part-{first:09d}-{last:09d}.parquet"
        files.atomic_write(path, lambda tmp: pq.write_table(t, tmp))

    def add(self, step: int, *, params: list[dict] | None = None, summary: dict | None = None,
            activations: list[dict] | None = None, noise_levels: list[dict] | None = None,
            loss_weight: list[dict] | None = None, dumps: dict[str, "torch.Tensor"] | None = None, dump_metadata: dict[str, str] | None = None) -> None:
        """Buffers one step's rows; flushes when `flush_every` steps have passed since the last flush
        or `max_rows` rows are buffered."""
        self._last_step = max(self._last_step, step)
        for table, rows in (("param_grads", params), ("act_grads", activations), ("steps", [summary] if summary else None),
                            ("noise_levels", noise_levels), ("loss_weight", loss_weight)):
            if rows:
                self._buf[table].append(pa.Table.from_pylist(rows, schema=SCHEMAS[table]))
                self._rows += len(rows)
        if summary is not None:
            self._tsv_buf.append("\t".join(_tsv_value(summary.get(c, math.nan)) for c in TSV_COLUMNS) + "\n")
        if dumps:
            (self.out_dir / "dumps").mkdir(exist_ok=True)
            path = self.out_dir / "dumps" / f"step-{step:09d}.safetensors"
            files.save_weights(dumps, path, metadata={"step": str(step), **(dump_metadata or {})})
        if step + 1 - self._last_flush >= self.flush_every or self._rows >= self.max_rows:
            self.flush()

    def flush(self) -> None:
        """Writes everything buffered as one chunk per table."""
        self._write_buffer(keep=False)

    def snapshot(self) -> None:
        """Writes everything buffered, and keeps it buffered for the chunk it belongs to (call it
        before saving a checkpoint, which notes `unflushed_from`)."""
        self._write_buffer(keep=True)

    def _write_buffer(self, *, keep: bool) -> None:
        written = []
        for table, parts in self._buf.items():
            if parts:
                t = pa.concat_tables(parts)
                lo, hi = pc.min_max(t["step"]).values()
                self._write_part(table, t, lo.as_py(), hi.as_py())
                written.append(self.out_dir / table / f"part-{lo.as_py():09d}-{hi.as_py():09d}.parquet")
                parts[:] = [t] if keep else []
        for f in self._snapshot:  # the new files hold their rows
            if f not in written:
                f.unlink(missing_ok=True)
        self._snapshot = written if keep else []
        if self._tsv_buf:  # (steps.tsv is appended to, whatever the chunks: a snapshot writes its lines for good)
            with open(self.out_dir / "steps.tsv", "a") as f:
                f.writelines(self._tsv_buf)
            self._tsv_buf.clear()
        if not keep:
            self._rows = 0
            self._last_flush = self._last_step + 1

    def close(self) -> None:
        self.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _tsv_value(v) -> str:
    if isinstance(v, bool):
        return str(int(v))
    return repr(float(v)) if isinstance(v, float) else str(v)


def read_table(out_dir: str | Path, table: str):
    """The whole table as a pandas DataFrame (empty, with the schema's columns, if nothing was written)."""
    d = Path(out_dir) / table
    if d.exists() and any(_PART.fullmatch(f.name) for f in d.iterdir()):
        return pq.read_table(d, schema=SCHEMAS[table]).to_pandas()
    return SCHEMAS[table].empty_table().to_pandas()


# --- integrity ---------------------------------------------------------------------------------

# The exported tables' sums, written by train beside them. DVC checks its cache's objects by their
# md5 only when asked to, and pulled damaged objects from a remote without a word: a figure drawn
# from changed numbers would look like a finding.
SUMS_FILE = "SHA256SUMS"
_REEXPORT = ("re-export them: `dvc repro --force train` (from the run's checkpoint where it is there: a finished "
             "run is not retrained), or `dvc pull --force` them from a remote")


def _damaged_fix(path: Path) -> str:
    """What to do about a table whose sum differs. An output checked out by DVC is a hard link to
    its cache (.dvc/config): the cached copy is damaged too, and DVC keeps it when the stage runs
    again, and `dvc pull --force` and `dvc checkout` trust it and link it back (checked with DVC
    3.67): the cached copy goes first, then the re-export or the pull."""
    try:
        links = os.stat(path).st_nlink
    except OSError:
        links = 1
    if links < 2:
        return _REEXPORT
    return (f"its bytes are shared by {links} hard links (DVC's cache, which pull and checkout trust): first delete "
            f"the cached copy (`find .dvc/cache -samefile {path} -delete`), then {_REEXPORT}")


def table_files(out_dir: str | Path) -> list[str]:
    """Every file below `out_dir` (relative, '/'-separated, sorted) but the sums and the hidden
    files (a killed writer's temp `.name.tmp.pid`, never read)."""
    out_dir = Path(out_dir)
    return sorted(f.relative_to(out_dir).as_posix() for f in out_dir.rglob("*")
                  if f.is_file() and f.name != SUMS_FILE and not f.name.startswith("."))


def write_sums(out_dir: str | Path) -> None:
    """`out_dir`/SHA256SUMS for every table file, in `sha256sum`'s format (`sha256sum -c` checks it)."""
    out_dir = Path(out_dir)
    files.atomic_write_text(out_dir / SUMS_FILE,
                            "".join(f"{files.sha256(out_dir / n)}  {n}\n" for n in table_files(out_dir)))


def verify_sums(out_dir: str | Path) -> None:
    """Checks every table file of `out_dir` against its SHA256SUMS: one `files.CheckpointError`
    line naming the first file that differs, is missing, or is not listed, and what to do."""
    out_dir = Path(out_dir)
    manifest = out_dir / SUMS_FILE
    if not manifest.is_file():
        raise files.CheckpointError(
            f"{manifest}: not found, so the tables cannot be checked (written before ddpmrepro kept their sums, or "
            f"deleted); {_REEXPORT}")
    want = {}
    for line in manifest.read_text().splitlines():
        digest, _, name = line.partition("  ")
        if not re.fullmatch(r"[0-9a-f]{64}", digest) or not name or name.startswith("/") or ".." in name.split("/"):
            raise files.CheckpointError(f"{manifest}: not a SHA256SUMS file (line {line[:80]!r}); {_REEXPORT}")
        want[name] = digest
    have = table_files(out_dir)
    for name in have:
        if name not in want:
            raise files.CheckpointError(f"{out_dir / name}: not listed in {manifest}, so it cannot be checked; "
                                        f"remove it, or {_REEXPORT}")
    for name in want:
        if name not in have:
            raise files.CheckpointError(f"{out_dir / name}: missing (listed in {manifest}); {_REEXPORT}")
        if files.sha256(out_dir / name) != want[name]:
            raise files.CheckpointError(f"{out_dir / name}: sha256 differs from {manifest} (damaged or modified since "
                                        f"train wrote it); {_damaged_fix(out_dir / name)}")


__all__ = ["PARAM_GRADS_SCHEMA", "STEPS_SCHEMA", "ACT_GRADS_SCHEMA", "NOISE_LEVELS_SCHEMA", "SCHEMAS", "TSV_COLUMNS", "TableWriter", "read_table", "SUMS_FILE", "table_files", "write_sums", "verify_sums"]

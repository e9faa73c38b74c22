"""The training log: dvclive's curves (rank 0) and a progress line, written at log steps.

dvclive writes into the run directory while training (DVC deletes a stage's outputs before
rerunning it, so a resumed run would lose the rows written before the kill); the export at the
end copies it to the DVC output. On resume, the rows logged after the checkpoint are dropped first.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

from .. import files
from ..outputs import TIMING


class TrainLog:
    """`log(done, summary)` at log steps; TIMING (images/s) is measured here, between two log steps."""

    def __init__(self, live_dir: Path, *, start_step: int, total_steps: int, images_per_step: int, main: bool):
        self.main, self.images_per_step = main, images_per_step
        self.live = None
        if main:
            from dvclive import Live

            live_dir.mkdir(parents=True, exist_ok=True)
            if start_step:
                truncate_live_history(live_dir, start_step)
            self.live = Live(dir=str(live_dir), dvcyaml=False, save_dvc_exp=False, resume=start_step > 0)
        self.progress = _progress(main, start_step, total_steps)
        self.t_last, self.step_last = time.perf_counter(), start_step

    def throughput(self, done: int) -> float:
        """Images per second since the last call (every rank's images), and a new window."""
        now = time.perf_counter()
        rate = (done - self.step_last) * self.images_per_step / (now - self.t_last)
        self.t_last, self.step_last = now, done
        return rate

    def log(self, done: int, summary: dict) -> None:
        if not self.main:
            return
        self.live.step = done
        for k, v in summary.items():
            if k != "step":
                self.live.log_metric(k, v)
        # The throughput is plotted (its TSV is git's), but kept out of dvclive's metrics.json, a DVC
        # cached out: a timing there gave it new bytes on every rerun, so a fresh clone's cache never
        # held the committed dvc.lock's version and `dvc checkout` failed for it (found from outside).
        self.live.summary.pop(TIMING, None)
        self.live.next_step()
        self.progress(done, summary)

    def end(self) -> None:
        if self.live is not None:
            self.live.end()


def truncate_live_history(live_dir: Path, start_step: int) -> None:
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
        # Atomic: a kill during a plain rewrite could leave the file empty, the whole history lost.
        files.atomic_write_text(tsv, "\n".join([header, *kept]) + "\n")


def _progress(main: bool, start: int, total: int):
    """A tqdm bar with ETA in a terminal; plain periodic lines otherwise (logs, CI, SLURM)."""
    if not main:
        return lambda done, summary: None
    if sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=total, initial=start, desc="train", dynamic_ncols=True)

        def update(done, summary):
            bar.update(done - bar.n)
            bar.set_postfix(loss=f"{summary['loss']:.4f}", img_s=f"{summary[TIMING]:.0f}")
            if done == total:
                bar.close()
        return update
    t0 = time.perf_counter()

    def line(done, summary):
        el = time.perf_counter() - t0
        eta = el / max(1, done - start) * (total - done)
        print(f"step {done}/{total} loss {summary['loss']:.4f} mse {summary['mse']:.4f} "
              f"grad_norm {summary['grad_norm']:.3f} lr {summary['lr']:.2e} "
              f"{summary[TIMING]:.0f} img/s eta {eta:.0f}s", file=sys.stderr, flush=True)
    return line

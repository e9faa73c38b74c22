"""The directories ddpmrepro writes whole, and how each is recognised.

A stage replaces its output directory whole (`files.replacing_dir`), and replacing deletes the old
one. So a directory is replaced only where it is missing, empty, or already an output of the same
kind: an output option pointed by mistake at the model, the data, a folder of documents or the
project itself is refused before anything is computed or written, instead of being deleted.

A kind is recognised by the names its writer always puts there (`signatures`: any one set, all of
its names present). No marker file is added, so outputs written by earlier versions are recognised
as they are, and no output's DVC hash changes.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class OutputKind:
    name: str  # what the error calls it, with its article: "a samples directory (sample, sample-superres)"
    signatures: tuple[frozenset[str], ...]

    def recognises(self, names) -> bool:
        names = set(names)
        return any(signature <= names for signature in self.signatures)

    def describe_signatures(self) -> str:
        return " or ".join(" + ".join(sorted(s)) for s in self.signatures)


def _kind(name: str, *signatures: set[str]) -> OutputKind:
    return OutputKind(name, tuple(frozenset(s) for s in signatures))


# The one value training logs that measures the wall clock. Kept out of every output DVC hashes
# (dvclive's metrics.json, config.json's `final`, the training-curves figure), so a rerun of the same
# training gives the same bytes: only dvclive's TSV of it (.dvcignore'd) and evaluate's detail file hold it.
TIMING = "images_per_sec"

PREPARED = _kind("a prepared dataset (prepare)", {"manifest.json"})
EVALUATOR = _kind("an evaluator directory (fit-evaluator)", {"config.json", "metrics.json", "model.safetensors"})
MODEL = _kind("a model directory (train, import)", {"config.json", "SHA256SUMS"})
# dvclive makes plots/ at the first logged step; the import-only train stage makes it too.
TRAIN_LOG = _kind("a dvclive directory (train --live)", {"plots"})
INTROSPECTION = _kind("an introspection directory (train --introspect)", {"steps.tsv"}, {"steps"}, {"param_grads"},
                      {"act_grads"}, {"noise_levels"}, {"loss_weight"})
SAMPLES = _kind("a samples directory (sample, sample-superres)", {"samples.npz"})
DIFFUSERS = _kind("a diffusers pipeline folder (export)", {"model_index.json"})
# Every report of a trained model draws the training curves; an imported one's says so instead.
FIGURES = _kind("a figures directory (report)", {"training_curves.png"}, {"IMPORTED.txt"})


GITIGNORE = ".gitignore"


class OutputRefused(ValueError):
    """An output directory that replacing would destroy: one line naming it, what it is not, and the fix."""


def replace_refusal(path: Path, kind: OutputKind) -> str | None:
    """Why `path` must not be replaced by a new `kind` output, or None where it may be: it does not
    exist, or it is an empty directory, or one `kind` recognises. The working directory and the
    directories above it are never replaced (swapping them out deletes the project)."""
    path = Path(path)
    if not path.exists():
        return None
    if not path.is_dir():
        return "is a file; a directory is needed"
    here, target = Path.cwd().resolve(), path.resolve()
    if target == here or target in here.parents:
        return (f"is the working directory{'' if target == here else ' or one above it'}; the output replaces "
                "its directory whole, which would delete everything in it: name a new directory")
    # DVC's `.gitignore` (listing the outputs inside, e.g. reports/train/live/metrics.json) is all that is
    # left once DVC has removed a killed stage's outputs; `replacing_dir` keeps it.
    names = [n for n in os.listdir(path) if n != GITIGNORE]
    if not names or kind.recognises(names):
        return None
    return (f"is not empty and is not {kind.name} (it has no {kind.describe_signatures()}); the output "
            "replaces its directory whole, which would delete what is there: name a new or empty "
            "directory, or remove this one first")


def check_replaceable(path: Path, kind: OutputKind) -> None:
    """Raises OutputRefused where `replace_refusal` gives a reason."""
    problem = replace_refusal(path, kind)
    if problem:
        raise OutputRefused(f"{path}: {problem}")

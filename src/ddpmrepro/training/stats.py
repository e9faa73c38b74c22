"""Training statistics: reported where a value arises, reduced over ranks at log steps.

`stats.report("loss", per_example_loss, finite)` adds the values to running sums that stay on
the device (no host sync between log steps); `stats.means()` all-reduces the sums of every rank
once, returns each statistic's mean over the window, and starts the next window. The sums are
part of the checkpoint, so a run resumed in the middle of a log window logs the same means as an
uninterrupted one.

The statistics are declared up front (name -> number of groups): the sums live in one float64
buffer, which is what makes the reduction one collective and the checkpointed state one tensor.
"""
from __future__ import annotations

import math

import torch

from ..runtime import distributed as D


class RunningStats:
    """Running sums and counts of declared statistics, some of them split into groups.

    A statistic with `groups > 1` is reported with a group index per value (e.g. the loss per
    timestep quartile) and its mean is logged per group as `<name><i>`.
    """

    def __init__(self, declared: dict[str, int], device: torch.device):
        self.declared = dict(declared)
        size = 2 * sum(declared.values())  # a sum and a count per group
        self.buffer = torch.zeros(size, dtype=torch.float64, device=device)
        self._slices, offset = {}, 0
        for name, groups in declared.items():
            self._slices[name] = self.buffer[offset:offset + 2 * groups].view(2, groups)  # (sums, counts)
            offset += 2 * groups

    @torch.no_grad()
    def report(self, name: str, values: torch.Tensor, keep: torch.Tensor | None = None,
               group: torch.Tensor | None = None) -> None:
        """Adds `values` (any shape; `keep` masks out e.g. non-finite entries, which would poison the
        window's mean) to `name`'s sums; with `group`, each value to its group's sum.

        Ungrouped values are summed in their own dtype, then accumulated in float64; grouped ones
        are accumulated in float64 value by value."""
        sums, counts = self._slices[name]
        values = values.detach()
        if keep is not None:
            values = torch.where(keep, values, 0.0)
        counted = torch.ones_like(values, dtype=torch.bool) if keep is None else keep
        if group is None:
            sums[0] += values.sum().double()
            counts[0] += counted.sum().double()
        else:
            sums.index_add_(0, group, values.double())
            counts.index_add_(0, group, counted.double())

    def means(self) -> dict[str, float]:
        """This window's means over every rank (a collective: every rank calls it), then a new window.

        An ungrouped statistic with no values is NaN; an empty group is left out."""
        if D.world_size() > 1:
            D.all_reduce_sum_(self.buffer)
        out = {}
        host = self.buffer.cpu()  # one copy, one wait for the device, per log step
        offset = 0
        for name, groups in self.declared.items():
            sums, counts = host[offset:offset + 2 * groups].view(2, groups).tolist()
            offset += 2 * groups
            if groups == 1:
                out[name] = sums[0] / counts[0] if counts[0] else math.nan
            else:
                out.update({f"{name}{i}": s / c for i, (s, c) in enumerate(zip(sums, counts)) if c})
        self.buffer.zero_()
        return out

    def state_dict(self) -> torch.Tensor:
        """(world, size) on the host: every rank's sums of the window in progress (a collective)."""
        return D.gather_rows(self.buffer)

    def load_state_dict(self, rows: torch.Tensor) -> None:
        """This rank's row; resumed under another number of processes, rank 0 carries all of them
        (the data order differs then anyway)."""
        rank, world = D.rank(), D.world_size()
        self.buffer.copy_(rows[rank] if len(rows) == world else rows.sum(0) * (rank == 0))

"""Processes and machines: 1 process or torchrun (on SLURM, srun torchrun), workers that die with
their launcher, the process group, and machine-wide slots for GPUs and CPU cores."""

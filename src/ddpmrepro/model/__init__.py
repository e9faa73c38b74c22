"""The method: the UNet, the diffusion math (schedules, losses, samplers) and respacing, and the
equations of EDM2's post-hoc EMA (`phema.py`: profiles, decay, the least-squares solve).

Pure torch: nothing here knows DDP, autocast, logging, files or params.yaml, and no network keeps
an EMA (the averaging itself is `training/ema.py`, `training/phema.py`). Which steps a
respaced sampler keeps is `ddpmrepro/respace.py`, below this folder, because params.py checks
`sample.respacing` with the same rule.
"""

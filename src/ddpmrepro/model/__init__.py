"""The method: the UNet, the diffusion math (schedules, losses, samplers) and respacing.

Pure torch: nothing here knows DDP, autocast, EMA, logging, files or params.yaml. Which steps a
respaced sampler keeps is `ddpmrepro/respace.py`, below this folder, because params.py checks
`sample.respacing` with the same rule.
"""

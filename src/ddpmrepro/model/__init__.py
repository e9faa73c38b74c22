"""The method: the UNet, the diffusion math (schedules, losses, samplers) and respacing.

Pure torch: nothing here knows DDP, autocast, EMA, logging, files or params.yaml.
"""

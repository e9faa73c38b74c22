"""The training run: the loop, its checkpoints, EMA, the timestep sampler, the batches and the
gradient introspection. `loop.train` is the only place that puts them together with DDP and AMP."""

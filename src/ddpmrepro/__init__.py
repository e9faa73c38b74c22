"""ddpmrepro: a reproducible class-conditional DDPM/IDDPM pipeline that shows what the gradients do."""

__version__ = "0.1.0"

"""The process around the program: simulated CPU devices, XLA flags, jax.distributed, signals and
time limits, library logs."""

"""dsjax: train DeepSeek language models with JAX/XLA on a sharded (data, tensor, pipeline) mesh."""

__version__ = "0.1.0"

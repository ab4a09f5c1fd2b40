"""Dynamic global batch size: a ladder of sizes, gradient accumulation, memory predicted from the
compiled program, and the controller that moves along the ladder (docs/batching.md).

shapes (a batch as micro-batches x accumulation x replicas) · accumulate (inside the step) ·
programs (the one compile path, and memory planning) · controller (the policy) · batcher (the
loop's view).
"""

from dsjax.batching.accumulate import accumulate, scale_updates
from dsjax.batching.batcher import Batcher
from dsjax.batching.controller import Change, Controller
from dsjax.batching.programs import Programs, divisors, plan_micro_batch
from dsjax.batching.shapes import (Shape, abstract_batch, batch_shape, host_layout, lr_scale,
                                   step_sharding)

__all__ = ["Batcher", "Change", "Controller", "Programs", "Shape", "abstract_batch",
           "accumulate", "batch_shape", "divisors", "host_layout", "lr_scale",
           "plan_micro_batch", "scale_updates", "step_sharding"]

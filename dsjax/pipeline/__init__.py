"""Pipeline parallelism over the "pipeline" mesh axis: the decoder's layer stack cut into stages
that microbatches stream through (gpipe, circular and 1f1b schedules). See docs/pipeline.md.

`pipelined` (the `Pipelined` loss and `make`), `stages` (what every schedule shares), `gpipe`
(the forward pipeline of gpipe and circular), `one_f_one_b` (1F1B with its own backward).
"""

from dsjax.pipeline.pipelined import Pipelined, make
from dsjax.pipeline.stages import StagedModel, bubble_fraction, ticks

__all__ = ["Pipelined", "StagedModel", "bubble_fraction", "make", "ticks"]

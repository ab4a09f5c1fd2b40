"""The precision policy: which projections of which decoder layers run as fp8 GEMMs, which in
float32, and how fp8 scales. A value built once from the config (`dsjax.model.build`); each layer
takes the policy of its own choice (`Fp8Policy.for_choice`)."""

from __future__ import annotations

import dataclasses

from dsjax.config.layer_map import Choice
from dsjax.fp8 import DEFAULT_HISTORY


@dataclasses.dataclass(frozen=True)
class Fp8Policy:
    """Which projections of which layers run as fp8 GEMMs (or float32), and how fp8 scales.
    Built once from the config (`dsjax.model.build.fp8_policy`); every layer takes the policy of
    its own choice (`for_choice`); None: no fp8 anywhere."""
    matmuls: tuple[str, ...]  # projection names: q, k, v, o (attention), gate, up, down (MLP)
    recipe: str = "current"  # one of RECIPES
    history: int = DEFAULT_HISTORY  # amax history length of the "delayed" recipe
    layers: tuple[Choice, ...] = ()  # per layer: (fp8 projections, float32 projections), the
                                     # rest in the compute dtype; () = `matmuls` in every layer
    margin: float = 0.0  # "delayed": scales are multiplied by 2**margin (`commit`)
    float32: tuple[str, ...] = ()  # projections of this layer that run in float32
    probe: str = ""  # a probe's model (dsjax.precision): the dtype every projection in
                     # `matmuls` is measured in beside fp8 and float32; "" = training

    @property
    def delayed(self) -> bool:
        """Delayed scaling of at least one matmul: the model carries `META_COLLECTION` state."""
        return self.recipe == "delayed" and bool(self.matmuls)

    def runs(self, name: str, layer: int | None = None) -> bool:
        """Does matmul `name` of layer `layer` run in fp8? (`layer` None: of this policy's
        layer, or of a layer that runs every matmul.)"""
        if self.probe:  # the probe's model measures fp8, it runs everything in float32
            return False
        if layer is None or not self.layers:
            return name in self.matmuls
        return name in self.layers[layer][0]

    def widens(self, name: str) -> bool:
        """Does matmul `name` of this policy's layer run in float32?"""
        return name in self.float32

    def layer_choices(self, num_layers: int) -> tuple[Choice, ...]:
        """Per layer of a `num_layers` stack: its (fp8 projections, float32 projections)."""
        return self.layers or ((self.matmuls, self.float32),) * num_layers

    def for_choice(self, choice: Choice) -> Fp8Policy:
        """The policy of one layer whose choice is `choice`."""
        return dataclasses.replace(self, matmuls=choice[0], float32=choice[1], layers=())

    def layer_range(self, lo: int, hi: int) -> Fp8Policy:
        """The policy of layers [lo, hi) as a stack of their own (a pipeline chunk)."""
        return dataclasses.replace(self, layers=self.layers[lo:hi])

"""Automatic per-layer precision (`fp8.select=auto`): the probe, the choice, the controller that
revisits it during training, and its report. docs/precision.md."""

from dsjax.precision.choose import Choices, verdicts
from dsjax.precision.probe import Probe
from dsjax.precision.selector import Selector

__all__ = ["Choices", "Probe", "Selector", "verdicts"]

"""Checkpoints: the `Checkpointer` (save, restore onto any mesh, fall back past a corrupt step;
checkpointer), what a step holds read without arrays and how it is compared with a run (meta),
and crash safety by sealing (seal). Weights only: `restore_params` / `save_params`."""

from dsjax.checkpoint.checkpointer import (ITEMS, Checkpointer, all_finite, restore_params,
                                           save_params)
from dsjax.checkpoint.meta import (check_model, find_steps, item_leaves, key_path, leaves_by_path,
                                   mismatch, model_meta, try_read_meta, tree_difference)
from dsjax.checkpoint.seal import MANIFEST, TMP_SUFFIX, incomplete_entries, seal, verify
from dsjax.errors import CheckpointCorrupt, CheckpointError

__all__ = ["ITEMS", "MANIFEST", "TMP_SUFFIX", "CheckpointCorrupt", "CheckpointError",
           "Checkpointer", "all_finite", "check_model", "find_steps", "incomplete_entries",
           "item_leaves", "key_path", "leaves_by_path", "mismatch", "model_meta",
           "restore_params", "save_params", "seal", "tree_difference", "try_read_meta", "verify"]

"""What a step holds, read without any array: discovery, the `meta` item (model config, step,
`train_layout`), and the saved trees' paths and shapes compared with a run's state.

The one idea: a difference between a checkpoint and this run's config is found from metadata
before any array is read, and is a config mismatch (CheckpointError naming what differs), never
corruption. Orbax stores NamedTuples and dataclasses as dicts and tuples as lists, so both sides
are compared as {path of names: leaf} (`leaves_by_path`).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from dsjax.config import ModelConfig
from dsjax.errors import CheckpointError

def find_steps(directory: str) -> tuple[str, ocp.CheckpointManager]:
    """(the directory holding the steps, its manager) for a converted checkpoint, a run workdir
    or its `checkpoints/` dir: the first of `directory`, `directory/checkpoints` with a step."""
    for candidate in (directory, os.path.join(directory, "checkpoints")):
        if os.path.isdir(candidate):
            manager = ocp.CheckpointManager(os.path.abspath(candidate))
            if manager.latest_step() is not None:
                return candidate, manager
    raise CheckpointError(f"no checkpoint found in {directory!r}")


def try_read_meta(manager: ocp.CheckpointManager, step: int
              ) -> tuple[dict[str, Any] | None, str | None]:
    """(the `meta` item of `step`, None), or (None, why it is unreadable: "Type: message"), for
    each caller to report in its own terms (corrupt step, fallback, conversion error)."""
    try:
        restored = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    except Exception as e:  # pylint: disable=broad-except  # Orbax raises many types
        return None, f"{type(e).__name__}: {e}"
    return restored["meta"], None



def item_leaves(step_dir: str, item: str) -> tuple[dict[tuple[str, ...], Any] | None, str | None]:
    """({path: metadata with shape and dtype} of `item` ("params", "train") in `step_dir`, None),
    read from its metadata (no array), or (None, why it is unreadable: "Type: message")."""
    handler = ocp.StandardCheckpointHandler()
    try:
        return leaves_by_path(handler.metadata(epath.Path(os.path.join(step_dir, item))).tree), None
    except Exception as e:  # pylint: disable=broad-except  # Orbax raises many types
        return None, f"{type(e).__name__}: {e}"
    finally:
        handler.close()


def model_meta(model: ModelConfig, step: int, errors_layout: dict | None = None,
               train_layout: dict | None = None) -> dict[str, Any]:
    """The `meta` item. `train_layout`: the settings that decide the `train` item's tree (absent
    in older checkpoints: unknown)."""
    meta = {"format": "dsjax-checkpoint-v1", "model": dataclasses.asdict(model), "step": int(step)}
    if errors_layout is not None:
        meta["errors_layout"] = errors_layout
    if train_layout is not None:
        meta["train_layout"] = train_layout
    return meta


def key_path(path: tuple) -> tuple[str, ...]:
    """A pytree key path as strings. Orbax stores NamedTuples and dataclasses as dicts and tuples
    as lists, so dict keys, sequence indices and attribute names are one kind of name here."""
    return tuple(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def leaves_by_path(tree: Any) -> dict[tuple[str, ...], Any]:
    """{key_path: leaf} (empty containers and None have no leaves, on either side)."""
    return {key_path(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def tree_difference(saved: dict[tuple, Any], here: dict[tuple, Any]) -> str | None:
    """The first difference in paths or shapes between two `leaves_by_path` maps, in words (and
    how many more there are), or None if they match. Dtypes may differ: Orbax casts."""
    diffs = []
    for path in sorted(set(saved) | set(here)):
        name = "/".join(path)
        if path not in saved:
            diffs.append(f"{name} is in this run's state but not in the checkpoint")
        elif path not in here:
            diffs.append(f"{name} is in the checkpoint but not in this run's state")
        elif tuple(saved[path].shape) != tuple(here[path].shape):
            diffs.append(f"{name} has shape {tuple(saved[path].shape)} in the checkpoint, "
                         f"{tuple(here[path].shape)} here")
    if not diffs:
        return None
    return diffs[0] + (f", and {len(diffs) - 1} more differences" if len(diffs) > 1 else "")


def mismatch(where: str, directory: str, problem: str,
             cause: str = "a model or optimizer field changed") -> CheckpointError:
    """The one error of a checkpoint that does not fit this config, with the ways to go on."""
    return CheckpointError(
        f"{where} does not match this config ({cause}): {problem}. Nothing was changed. To go "
        f"on, run with the config that wrote it, or start a new --workdir (with "
        f"--config.checkpoint.init_from={directory} to take its weights only)")


def check_model(meta: dict[str, Any], model: ModelConfig, where: str) -> None:
    """Fails with one message naming every model field that differs from the checkpoint's."""
    saved = meta.get("model", {})
    want = dataclasses.asdict(model)
    shape_keys = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "mlp_dim", "vocab_size",
                  "head_dim")
    diffs = [f"model.{k}: checkpoint has {saved.get(k)!r}, config has {want[k]!r}"
             for k in shape_keys if saved.get(k) != want[k]]
    # MLA/MoE/MTP shape fields; checkpoints written before they existed hold the defaults (off).
    defaults = dataclasses.asdict(ModelConfig(1, 1, 1, 1, 1, 1))
    diffs += [f"model.{k}: checkpoint has {saved.get(k, defaults[k])!r}, config has {want[k]!r}"
              for k in ("attention", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                        "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "n_shared_experts",
                        "moe_intermediate_size", "first_k_dense_replace", "scoring",
                        "num_mtp_layers")
              if saved.get(k, defaults[k]) != want[k]]
    # Not shapes, but restoring under another value silently computes a different model.
    diffs += [f"model.{k}: checkpoint has {saved.get(k)!r}, config has {want[k]!r}"
              for k in ("rope_theta", "norm_eps")
              if saved.get(k) is None or not math.isclose(saved[k], want[k], rel_tol=1e-9)]
    if diffs:
        raise CheckpointError(f"{where} was written for a different model shape: " + "; ".join(diffs))


"""Every user-facing error type: the ground floor that every other module may import.

`USER_ERRORS` are the types launch.py reports as one line, `dsjax: error: ...`, with exit 2 (no
traceback): bad input (config, data, checkpoint, weights) or a run that cannot continue.
`unknown_choice` is the one wording of "not one of the valid values", for every layer.
"""

from __future__ import annotations

from typing import Iterable


class ConfigError(ValueError):
    """A config value is invalid; the message names the field."""


class DistributedError(ConfigError):
    """The multi-process settings are incomplete or inconsistent; the message names them."""


class RematError(ValueError):
    """An unknown remat policy or pattern; the message lists the valid ones."""


class DataError(ValueError):
    """Bad input data: missing or corrupt file, bad line, too little data. Names the file."""


class CheckpointError(ValueError):
    """A checkpoint is missing, incompatible or corrupt; the message names it."""


class CheckpointCorrupt(CheckpointError):
    """A complete checkpoint's files are damaged (truncated, altered, missing)."""


class SafetensorsError(ValueError):
    """A file is not valid safetensors, or a tensor is not where the index says; names it."""


class ConvertError(ValueError):
    """A Hugging Face directory or a checkpoint cannot be converted; the message names the tensor,
    field or file."""


class TrainingError(RuntimeError):
    """The run cannot continue (e.g. a non-finite loss); the message says why and where."""


USER_ERRORS = (ConfigError, DataError, CheckpointError, TrainingError)


def unknown_choice(what: str, value: object, valid: Iterable[str], field: str = "") -> str:
    """The one wording for a value outside its choices: `field: unknown WHAT 'v'; valid: a, b`."""
    where = f"{field}: " if field else ""
    return f"{where}unknown {what} {value!r}; valid: {', '.join(valid)}"


def one_of(field: str, value: object, valid: Iterable[str], what: str) -> None:
    """Raises a ConfigError naming `field` unless `value` is one of `valid`."""
    valid = tuple(valid)
    if value not in valid:
        raise ConfigError(unknown_choice(what, value, valid, field))

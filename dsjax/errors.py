"""Every user-facing error type: the ground floor that every other module may import.

`USER_ERRORS` are the types launch.py reports as one line, `dsjax: error: ...`, with exit 2 (no
traceback): bad input (config, data, checkpoint, weights) or a run that cannot continue.
"""


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

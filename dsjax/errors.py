"""The error types that mean "bad input or a stopped run", reported as one line, not a traceback."""

from dsjax.checkpoint import CheckpointError
from dsjax.config import ConfigError
from dsjax.data import DataError
from dsjax.train import TrainingError

USER_ERRORS = (ConfigError, DataError, CheckpointError, TrainingError)

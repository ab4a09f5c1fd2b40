"""Config: an `ml_collections.ConfigDict` in, frozen and validated dataclasses out.

sections.py holds the dataclasses (the only place defaults live), validate.py each section's
checks, compositions.py what does not combine with what, load.py files and command lines.
Importing this package never imports JAX (launch.py reads the config before JAX starts).
"""

from dsjax.config.compositions import compositions, warnings
from dsjax.config.load import (CommandLine, check_command_line, default_workdir, defaults,
                               from_config_dict, load, read_file, run_name)
from dsjax.config.sections import (SECTIONS, BatchConfig, CheckpointConfig, Config, DataConfig,
                                   FP8Config, MeshConfig, MetricsConfig, ModelConfig, OptimConfig,
                                   PipelineConfig, PosttrainConfig, RematConfig, TrainConfig,
                                   VisionConfig, trainable_groups)
from dsjax.config.validate import mix_weights, validate, validate_deepseek
from dsjax.errors import ConfigError

__all__ = ["BatchConfig", "CheckpointConfig", "CommandLine", "Config", "ConfigError", "DataConfig",
           "FP8Config", "MeshConfig", "MetricsConfig", "ModelConfig", "OptimConfig",
           "PipelineConfig", "PosttrainConfig", "RematConfig", "SECTIONS", "TrainConfig",
           "check_command_line", "compositions", "default_workdir", "defaults",
           "from_config_dict", "load", "read_file", "run_name", "VisionConfig", "mix_weights",
           "trainable_groups", "validate", "validate_deepseek", "warnings"]

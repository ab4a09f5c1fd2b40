"""dsjax entry point: `python launch.py --config configs/NAME.py[:ARG] [--config.a.b=v] [--workdir DIR]
[--mode train|eval]`. With no --config, trains the embedded default `configs/cpu_tiny.py`."""

import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

_HERE = os.path.dirname(os.path.abspath(__file__))
config_flags.DEFINE_config_file("config", os.path.join(_HERE, "configs", "cpu_tiny.py"),
                                "Config file (configs/NAME.py[:ARG]).", lock_config=True)
flags.DEFINE_string("workdir", None, "Run directory (default: runs/<config name>).")
flags.DEFINE_enum("mode", "train", ["train", "eval"], "Train (then evaluate) or only evaluate.")
flags.DEFINE_bool("verbose", False, "Show full tracebacks for configuration and input errors.")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    if not FLAGS.verbose:
        logging.set_verbosity(logging.WARNING)  # Orbax logs every file it renames at INFO
    config_arg = flags.FLAGS["config"].config_filename
    from dsjax.cpu_devices import ensure_cpu_devices
    from dsjax.config import from_config_dict
    path, _, arg = config_arg.partition(":")
    name = os.path.splitext(os.path.basename(path))[0] + (f":{arg}" if arg else "")
    try:
        cfg = from_config_dict(FLAGS.config, name=name)
        ensure_cpu_devices(cfg.mesh.data * cfg.mesh.tensor * cfg.mesh.pipeline)
        workdir = FLAGS.workdir or os.path.join("runs", name.replace(":", "_"))
        if FLAGS.mode == "train":
            from dsjax import train
            train.run(cfg, workdir)
        else:
            from dsjax import evaluate
            evaluate.run(cfg, workdir)
    except Exception as e:  # pylint: disable=broad-except
        from dsjax.errors import USER_ERRORS
        if FLAGS.verbose or not isinstance(e, USER_ERRORS):
            raise
        print(f"dsjax: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    app.run(main)

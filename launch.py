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
flags.DEFINE_string("coordinator", None, "Multi-process: HOST:PORT of process 0's coordinator "
                    "(else JAX_COORDINATOR_ADDRESS, or SLURM under srun; see docs/multihost.md).")
flags.DEFINE_integer("num_processes", None,
                     "Multi-process: how many processes (with --coordinator).")
flags.DEFINE_integer("process_id", None, "Multi-process: this process's index in [0, N).")
flags.DEFINE_integer("local_devices", None, "Simulated CPU devices in this process (default: the "
                     "mesh's device count / number of processes).")
flags.DEFINE_bool("verbose", False, "Show full tracebacks for configuration and input errors.")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    if not FLAGS.verbose:
        logging.set_verbosity(logging.WARNING)  # Orbax logs every file it renames at INFO
    config_arg = flags.FLAGS["config"].config_filename
    from dsjax import distributed
    from dsjax.cpu_devices import ensure_cpu_devices
    from dsjax.config import from_config_dict
    path, _, arg = config_arg.partition(":")
    name = os.path.splitext(os.path.basename(path))[0] + (f":{arg}" if arg else "")
    try:
        cfg = from_config_dict(FLAGS.config, name=name)
        cluster = (FLAGS.coordinator, FLAGS.num_processes, FLAGS.process_id)
        mesh_devices = cfg.mesh.data * cfg.mesh.tensor * cfg.mesh.pipeline
        if not FLAGS.local_devices:
            ensure_cpu_devices(mesh_devices, distributed.process_count(*cluster))
        distributed.maybe_initialize(*cluster, local_devices=FLAGS.local_devices)
        from dsjax import metrics, sharding
        metrics.log(distributed.describe_layout(sharding.make_mesh(cfg)))
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

"""dsjax entry point: `python launch.py --config configs/NAME.py[:ARG] [--config.a.b=v] [--workdir DIR]
[--mode train|eval]`. With no --config, trains the embedded default `configs/cpu_tiny.py`."""

import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

# None of these imports JAX: the XLA flags and the simulated device count must be set first.
from dsjax.config import (ConfigError, check_command_line, default_workdir, from_config_dict,
                          run_name)
from dsjax.errors import USER_ERRORS
from dsjax.runtime import distributed, xla_flags
from dsjax.runtime.cpu_devices import ensure_cpu_devices
from dsjax.runtime.logs import quiet_library_logs
from dsjax.runtime.preemption import parse_duration

_HERE = os.path.dirname(os.path.abspath(__file__))
_DEFAULT_CONFIG = os.path.join(_HERE, "configs", "cpu_tiny.py")


def _read_command_line():
    """Reads the config file once and checks the overrides, saying what is wrong in one line
    (ml_collections reports a bad file or key with a traceback)."""
    try:
        return check_command_line(sys.argv[1:], _DEFAULT_CONFIG)
    except ConfigError as e:
        if "--verbose" in sys.argv:
            raise
        print(f"dsjax: error: {e}", file=sys.stderr)
        sys.exit(2)


_COMMAND_LINE = _read_command_line()
_ARGV = sys.argv[:1] + _COMMAND_LINE.argv  # --config is read: ml_collections gets the dict
config_flags.DEFINE_config_dict("config", _COMMAND_LINE.raw, "Config file (configs/NAME.py[:ARG]); "
                                "then --config.SECTION.FIELD=VALUE overrides any field.",
                                lock_config=True, sys_argv=_ARGV)
flags.FLAGS["config"].default_as_str = repr(_COMMAND_LINE.config)  # --help: the file, not the dict
flags.DEFINE_string("workdir", None, "Run directory (default: runs/<config name>).")
flags.DEFINE_enum("mode", "train", ["train", "eval"], "Train (then evaluate) or only evaluate.")
flags.DEFINE_string("coordinator", None, "Multi-process: HOST:PORT of process 0's coordinator "
                    "(else JAX_COORDINATOR_ADDRESS, or SLURM under srun; see docs/multihost.md).")
flags.DEFINE_integer("num_processes", None,
                     "Multi-process: how many processes (with --coordinator).")
flags.DEFINE_integer("process_id", None, "Multi-process: this process's index in [0, N).")
flags.DEFINE_integer("local_devices", None, "Simulated CPU devices in this process (default: the "
                     "mesh's device count / number of processes).")
flags.DEFINE_string("max_runtime", None, "Wall-clock budget (3600, 90m, 2h, 1h30m): checkpoint and "
                    "exit 0 before the next step would exceed it; rerun to resume.")
flags.DEFINE_bool("allow_fallback", False, "If the newest checkpoint is corrupt, move it aside "
                  "and resume from the previous one (default: stop and say so).")
flags.DEFINE_bool("verbose", False, "Show full tracebacks for configuration and input errors.")
FLAGS = flags.FLAGS


def _max_runtime_s() -> float:
    if FLAGS.max_runtime is None:
        return 0.0
    try:
        seconds = parse_duration(FLAGS.max_runtime)
    except ValueError as e:
        raise ConfigError(f"--max_runtime: {e}") from None
    if seconds <= 0:
        raise ConfigError(f"--max_runtime: must be > 0, got {FLAGS.max_runtime!r}")
    return seconds


def main(argv):
    del argv
    if not FLAGS.verbose:
        logging.set_verbosity(logging.WARNING)  # Orbax logs every file it renames at INFO
    name = run_name(_COMMAND_LINE.config)
    try:
        cfg = from_config_dict(FLAGS.config, name=name)
        xla_flags.apply(cfg.mesh.xla_profile)  # XLA reads XLA_FLAGS once, at backend start
        cluster = (FLAGS.coordinator, FLAGS.num_processes, FLAGS.process_id)
        mesh_devices = cfg.mesh.size
        if not FLAGS.local_devices:
            ensure_cpu_devices(mesh_devices, distributed.process_count(*cluster))
        distributed.maybe_initialize(*cluster, local_devices=FLAGS.local_devices)
        # Local: these import JAX, which may start only now that XLA_FLAGS is final.
        import jax  # pylint: disable=g-import-not-at-top
        from dsjax import metrics, sharding  # pylint: disable=g-import-not-at-top
        workdir = FLAGS.workdir or default_workdir(name)
        plan = None
        if cfg.plan == "auto":  # the layout for the devices this run has (docs/planner.md)
            from dsjax.plan import auto  # pylint: disable=g-import-not-at-top  (imports JAX)
            cfg, plan = auto.planned_config(cfg, workdir, metrics.log)
        metrics.log(sharding.describe_layout(sharding.make_mesh(cfg)))
        metrics.log(xla_flags.summary(cfg.mesh.xla_profile))
        if not FLAGS.verbose:
            quiet_library_logs(workdir, jax.process_index())
        if FLAGS.mode == "train" and cfg.posttrain.recipe:
            from dsjax import posttrain  # pylint: disable=g-import-not-at-top  (imports JAX)
            posttrain.run(cfg, workdir, allow_fallback=FLAGS.allow_fallback,
                          max_runtime_s=_max_runtime_s())
        elif FLAGS.mode == "train":
            from dsjax import train  # pylint: disable=g-import-not-at-top  (imports JAX)
            train.run(cfg, workdir, allow_fallback=FLAGS.allow_fallback,
                      max_runtime_s=_max_runtime_s())
        elif cfg.posttrain.recipe:
            raise ConfigError("posttrain.recipe: --mode eval evaluates one run, and the recipe's "
                              "stages are runs of their own (WORKDIR/<stage>), scored in "
                              "WORKDIR/summary.json; `python -m dsjax.generate --workdir "
                              "WORKDIR/dpo` generates from its last stage")
        else:
            from dsjax import train  # pylint: disable=g-import-not-at-top  (imports JAX)
            train.run_eval(cfg, workdir, allow_fallback=FLAGS.allow_fallback)
        if plan is not None and FLAGS.mode == "train":
            auto.record_outcome(workdir, plan)
    except Exception as e:  # pylint: disable=broad-except
        if FLAGS.verbose or not isinstance(e, USER_ERRORS):
            raise
        print(f"dsjax: error: {e}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(2)  # pylint: disable=protected-access  # not sys.exit: Orbax's writer threads
                     # would keep the process alive (and talking) after a failed save


if __name__ == "__main__":
    app.run(main, argv=_ARGV)

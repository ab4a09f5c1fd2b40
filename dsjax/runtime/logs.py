"""Library logs out of the user's way, so a failed run's one line stays one line.

Libraries do their own reporting (Orbax logs a failed background write from each of its threads,
asyncio logs futures nobody awaited); without --verbose, `quiet_library_logs` sends that to a file
in the run directory, where the details are still kept.
"""

import logging
import os
import sys
import threading
import traceback


def quiet_library_logs(workdir: str, process_index: int = 0) -> str | None:
    """Routes Python logging (absl, Orbax, asyncio) and uncaught thread exceptions to
    WORKDIR/logs/process_N.log; returns its path (None if the directory is not writable: the
    run reports that itself)."""
    path = os.path.join(workdir, "logs", f"process_{process_index}.log")
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        stream = open(path, "a", encoding="utf-8", buffering=1)  # pylint: disable=consider-using-with
    except OSError:
        return None
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    logging.getLogger("absl").propagate = True

    def thread_hook(args):
        stream.write(f"exception in thread {args.thread.name if args.thread else '?'}:\n" +
                     "".join(traceback.format_exception(args.exc_type, args.exc_value,
                                                        args.exc_traceback)))

    def unraisable_hook(unraisable):
        stream.write(f"unraisable exception ({unraisable.err_msg or ''}):\n" +
                     "".join(traceback.format_exception(unraisable.exc_type,
                                                        unraisable.exc_value,
                                                        unraisable.exc_traceback)))

    threading.excepthook = thread_hook
    sys.unraisablehook = unraisable_hook
    return path

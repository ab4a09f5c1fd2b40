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


class _QuietHandler(logging.StreamHandler):
    """A log file that cannot be written (the disk the run fills up holds it too) drops the
    record: logging would otherwise print its own traceback over the run's one-line error."""

    def handleError(self, record: logging.LogRecord) -> None:
        del record


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
    handler = _QuietHandler(stream)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    logging.getLogger("absl").propagate = True

    def write(text: str) -> None:
        try:
            stream.write(text)
        except OSError:  # disk full: the details are lost, the run's own message is not
            pass

    def thread_hook(args):
        write(f"exception in thread {args.thread.name if args.thread else '?'}:\n" +
              "".join(traceback.format_exception(args.exc_type, args.exc_value,
                                                 args.exc_traceback)))

    def unraisable_hook(unraisable):
        write(f"unraisable exception ({unraisable.err_msg or ''}):\n" +
              "".join(traceback.format_exception(unraisable.exc_type, unraisable.exc_value,
                                                 unraisable.exc_traceback)))

    threading.excepthook = thread_hook
    sys.unraisablehook = unraisable_hook
    return path

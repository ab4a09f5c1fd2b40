"""The `slow` marker's list: tests/slow.txt names the tests that took SLOW_S seconds or more
(setup + call) in a full `make test` on 2 cores, and conftest marks them `slow`, so that
`pytest -n 2 -m "not slow" tests` is the quick loop while editing. The list is measured, not
guessed: after a full run that lists every duration,

    .venv/bin/python -m pytest -n 2 --dist worksteal --durations=0 tests > LOG
    python tests/slow.py LOG

rewrites it from the run's durations."""

import collections
import os
import re
import sys

SLOW_S = 20.0
LIST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "slow.txt")
_DURATION = re.compile(r"^([0-9.]+)s (setup|call|teardown)\s+(\S+)$")


def read() -> set[str]:
    """The node ids tests/slow.txt lists (comments and blank lines skipped)."""
    with open(LIST, encoding="utf-8") as f:
        return {line.strip() for line in f if line.strip() and not line.startswith("#")}


def from_durations(lines) -> dict[str, float]:
    """{node id: seconds of setup + call + teardown} from pytest's --durations lines."""
    total = collections.defaultdict(float)
    for line in lines:
        m = _DURATION.match(line.strip())
        if m:
            total[m.group(3)] += float(m.group(1))
    return dict(total)


def main(log: str) -> None:
    with open(log, encoding="utf-8") as f:
        seconds = from_durations(f)
    slow = sorted(n for n, s in seconds.items() if s >= SLOW_S)
    with open(LIST, "w", encoding="utf-8") as f:
        f.write(f"# Tests that took {SLOW_S:.0f} s or more in a full `make test` on 2 cores, "
                f"marked `slow` by conftest.\n# Rewritten by `python tests/slow.py LOG`.\n")
        f.writelines(f"{n}\n" for n in slow)
    print(f"{len(slow)} of {len(seconds)} timed tests took {SLOW_S:.0f} s or more: {LIST}")


if __name__ == "__main__":
    main(sys.argv[1])

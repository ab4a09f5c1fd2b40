"""The `slow` marker's measured list (tests/slow.py): read from pytest's durations, and naming
only tests that exist."""

import os
import re

import slow
from conftest import ROOT


def test_durations_add_up_per_test_and_only_slow_ones_are_listed(tmp_path, monkeypatch):
    log = tmp_path / "log"
    log.write_text("\n".join([
        "============ slowest durations ============",
        "12.00s call     tests/test_a.py::test_x[p-1]",
        "9.50s setup    tests/test_a.py::test_x[p-1]",
        "0.01s teardown tests/test_a.py::test_x[p-1]",
        "19.99s call     tests/test_b.py::test_y",
        "25.00s call     tests/test_b.py::test_z",
        "675 passed in 2075.23s (0:34:35)"]))
    with open(log, encoding="utf-8") as f:
        seconds = slow.from_durations(f)
    assert seconds.keys() == {"tests/test_a.py::test_x[p-1]", "tests/test_b.py::test_y",
                              "tests/test_b.py::test_z"}
    assert abs(seconds["tests/test_a.py::test_x[p-1]"] - 21.51) < 1e-9
    monkeypatch.setattr(slow, "LIST", str(tmp_path / "slow.txt"))
    slow.main(str(log))
    assert slow.read() == {"tests/test_a.py::test_x[p-1]", "tests/test_b.py::test_z"}


def test_every_listed_test_exists():
    for node in slow.read():
        path, _, name = node.partition("::")
        function = name.split("[")[0]
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            assert re.search(rf"^def {re.escape(function)}\(", f.read(), re.M), node

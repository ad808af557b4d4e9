"""The e2e tests' runner for commands that start deployments (tests/e2e/launcher.run_whole): on
timeout nothing the command started runs on into the next test."""

import subprocess
import sys
import time

import psutil
import pytest

from tests.e2e.launcher import run_whole

# A stand-in for the bench: it starts a child (as it starts launchers) and never ends.
STARTS_A_CHILD = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
print(child.pid, flush=True)
time.sleep(300)
"""


def test_a_command_that_times_out_is_stopped_with_everything_it_started():
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as e:
        run_whole([sys.executable, "-c", STARTS_A_CHILD], timeout=3)
    child = int(e.value.output.split()[0])
    assert time.monotonic() - t0 < 60
    deadline = time.monotonic() + 10
    while psutil.pid_exists(child) and psutil.Process(child).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, f"the command's child {child} outlived it"
        time.sleep(0.1)


def test_a_command_that_ends_is_answered_as_subprocess_run_would():
    done = run_whole([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"], 30)
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")

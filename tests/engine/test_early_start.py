import os
import signal
import subprocess
import sys
import time

import pytest

from tests.server.conftest import REPO, alive


def test_a_server_that_exits_before_its_engine_is_needed_leaves_no_engine_process():
    # what `serve` does when a flag or the port is refused after the engine's process started
    code = ("import sys, time; from nanoserve.engine.early_start import EarlyEngineProcess\n"
            "early = EarlyEngineProcess(); print(early.process.pid, flush=True); time.sleep(0.5)\n"
            "sys.exit('nanoserve: error: refused')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 1 and "refused" in result.stderr and "Traceback" not in result.stderr, result.stderr
    pid = int(result.stdout.split()[0])
    assert not alive(pid)


@pytest.mark.parametrize("delay", [0.3, 1.0, 2.0])
def test_ctrl_c_at_any_moment_of_a_start_ends_it_without_a_traceback_or_a_process_left(delay):
    # Ctrl-C reaches the whole process group: the server and the engine's process it started early
    def own_group() -> None:
        os.setpgrp()
        signal.signal(signal.SIGINT, signal.SIG_DFL)   # a test runner may have it ignored

    server = subprocess.Popen([sys.executable, "-m", "nanoserve.cli", "serve", "--port", "0", "--device", "cpu"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                              env={**os.environ, "PYTHONPATH": str(REPO)}, preexec_fn=own_group)
    time.sleep(delay)
    os.killpg(server.pid, signal.SIGINT)
    out, _ = server.communicate(timeout=120)
    assert "Traceback" not in out and "Error" not in out, out
    # still loading: interrupted; already serving: a clean stop
    assert server.returncode == 130 and "nanoserve: interrupted" in out or server.returncode == 0, out
    deadline = time.monotonic() + 15   # the engine's process and multiprocessing's tracker exit after it
    while subprocess.run(["pgrep", "-g", str(server.pid)], capture_output=True).returncode == 0:
        assert time.monotonic() < deadline, subprocess.run(["ps", "-o", "pid,args", "-g", str(server.pid)],
                                                           capture_output=True, text=True).stdout
        time.sleep(0.1)

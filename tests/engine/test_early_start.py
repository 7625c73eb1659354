import os
import subprocess
import sys

from tests.server.conftest import REPO


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_server_that_exits_before_its_engine_is_needed_leaves_no_engine_process():
    # what `serve` does when a flag or the port is refused after the engine's process started
    code = ("import sys, time; from nanoserve.engine.early_start import EarlyEngineProcess\n"
            "early = EarlyEngineProcess(); print(early.process.pid, flush=True); time.sleep(0.5)\n"
            "sys.exit('nanoserve: error: refused')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 1 and "refused" in result.stderr and "Traceback" not in result.stderr, result.stderr
    pid = int(result.stdout.split()[0])
    assert not _alive(pid)

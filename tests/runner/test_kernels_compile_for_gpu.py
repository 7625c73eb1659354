"""The decode kernels compile for a Hopper GPU on this machine without one (scripts/compile_for_gpu.py,
Triton's compiler and its ptxas): the other CPU tests run them under the interpreter, which accepts
code the GPU compiler refuses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_decode_and_merge_kernels_compile_for_sm90(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)   # compile for real, not from an earlier run's cache
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "compile_for_gpu.py"), "--only", "decode,merge"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "6 kernels compiled for sm90" in done.stdout, done.stdout

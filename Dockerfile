# nanoserve on a CUDA machine:
#   docker build -t nanoserve .
#   docker run --gpus all -p 8000:8000 -v /path/to/models:/models nanoserve /models/NAME
# Arguments after the image name go to `nanoserve serve` (no model: the bundled tiny one).
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

WORKDIR /opt/nanoserve
COPY pyproject.toml README.md ./
COPY nanoserve ./nanoserve
# torch's PyPI wheel brings its own CUDA libraries; the "gpu" extra adds triton for our kernels
RUN pip install ".[gpu]" \
    && useradd --create-home --uid 1001 nanoserve

# numeric, so that Kubernetes' runAsNonRoot can check it
USER 1001

EXPOSE 8000
# a large model takes minutes to load: /health answers only once the port is open
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["nanoserve", "serve"]

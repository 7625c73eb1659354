#!/usr/bin/env bash
# Wheels of the server's packages that the GPU device image lacks, for Python 3.12 on x86-64, into
# .whl/ (keep it out of git: echo /.whl/ >> .git/info/exclude). The versions are those installed
# here, so the device runs what the tests ran. On the device:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
set -euo pipefail
cd "$(dirname "$0")/.."
packages="fastapi starlette pydantic pydantic_core annotated-types typing-inspection uvicorn httptools pyzmq msgspec
          openai httpx2 httpcore2 truststore jiter orjson sniffio opentelemetry-api xgrammar apache-tvm-ffi
          py-spy"   # py-spy: sampling profiles of the host side on the device (bench/gpu_suite.sh spy-json)
pins=()
for name in $packages; do
  version=$(python3 -m pip show "$name" 2>/dev/null | awk '/^Version:/ {print $2}')
  [ -n "$version" ] || { echo "install $name here first (pip install -e .[test])" >&2; exit 1; }
  pins+=("$name==$version")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
  -d .whl "${pins[@]}"
ls .whl

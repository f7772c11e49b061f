#!/usr/bin/env bash
# Wheels the GPU machine lacks, into .whl/ (ignored by git), for the device
# tool to carry: run here (with internet/pip access) before a GPU session.
#
#   bash benchmarks/gpu_wheels.sh
#
# - transformers and peft at the versions installed here (the GPU machine has
#   transformers 5.17, whose Qwen3.5 takes only multimodal positions; CI uses
#   the same versions as this machine);
# - DeepSpeed built from its source release with DS_BUILD_OPS=0 (pure Python:
#   its CPU Adam compiles on the GPU machine, where nvcc and ninja are), and
#   what it needs that the GPU machine does not have (hjson, pydantic).
#
# benchmarks/gpu_session.sh installs whatever is in .whl/ into /tmp/site first.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
rm -rf .whl && mkdir -p .whl
platform=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
installed() { python -c "from importlib.metadata import version; print(version('$1'))"; }
python -m pip download -q --no-deps --only-binary=:all: "${platform[@]}" -d .whl \
    "transformers==$(installed transformers)" "peft==$(installed peft)"
# pydantic's own needs (pydantic-core is compiled: the GPU machine's Python 3.12)
python -m pip download -q --only-binary=:all: "${platform[@]}" -d .whl pydantic hjson
rm -f .whl/typing_extensions-*.whl  # the GPU machine has it: one version only
work=$(mktemp -d)
python -m pip download -q --no-deps --no-binary=:all: -d "$work" deepspeed
DS_BUILD_OPS=0 python -m pip wheel -q --no-deps --no-build-isolation -w .whl "$work"/deepspeed-*.tar.gz
rm -rf "$work"
ls -l .whl
du -sh .whl

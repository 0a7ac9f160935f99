#!/usr/bin/env bash
# CI for the verl engine (tests/test_integrations_verl.py) in a venv of its own: verl 0.9.1 pins
# transformers < 5.11, older than the main test venv's. torch first (a bare `torch` requirement
# would pull a CUDA build), then treetrain with the verl extra (its verl.plugins entry point is
# what the tests check; verl's `verl-core` extra: what verl's trainer imports), then the test tools.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv-verl
. .venv-verl/bin/activate
python -m pip install -q --no-compile --upgrade pip
python -m pip install -q --no-compile torch==2.13.0
python -m pip install -q --no-compile -e ".[verl]"
python -m pip install -q --no-compile "pytest>=8" "pytest-xdist>=3.5" "hypothesis>=6.100"
# CPU seconds (2-core machine under load): the parity file ~80 s of its slow cases, the host file ~46 s
# (three fresh interpreters, one torchrun worker), the vision-language parity file 50-90 s (three torchrun
# runs); verl-core's packages add ~30 s to the install
python -m pytest tests/test_integrations_verl.py tests/test_integrations_verl_host.py \
    tests/test_integrations_verl_vlm.py

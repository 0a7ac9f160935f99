#!/usr/bin/env bash
# The verl venv (.venv-verl): verl 0.9.1 pins transformers < 5.11, older than the main test venv's.
# torch first (a bare `torch` requirement would pull a CUDA build), then treetrain with the verl extra
# (its verl.plugins entry point is what the tests check; verl's `verl-core` extra: what verl's trainer
# imports), then the test tools. Writes .venv-verl/.installed last, so a half-made venv is redone.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv-verl
. .venv-verl/bin/activate
. .ci/install.sh
python -m pip install -q torch==2.13.0
ci_install -e ".[verl]" "pytest>=8" "pytest-xdist>=3.5" "hypothesis>=6.100"
touch .venv-verl/.installed

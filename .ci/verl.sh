#!/usr/bin/env bash
# CI for the verl engine (tests/test_integrations_verl*.py) in the venv of .ci/verl_venv.sh (made here
# unless .ci/run's background step made it already).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f .venv-verl/.installed ] || bash .ci/verl_venv.sh
. .venv-verl/bin/activate
# CPU seconds (2-core machine under load): the parity file ~80 s of its slow cases, the host file ~46 s
# (three fresh interpreters, one torchrun worker), the vision-language parity file 50-90 s (three torchrun
# runs)
python -m pytest tests/test_integrations_verl.py tests/test_integrations_verl_host.py \
    tests/test_integrations_verl_vlm.py

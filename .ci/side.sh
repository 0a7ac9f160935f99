#!/usr/bin/env bash
# The side jobs of .ci/run, one after another, in the background of the main suite: the docs
# (.ci/docs.sh, a venv of its own), the verl engine's tests (.ci/verl.sh, a venv of its own: verl pins
# an older transformers) and the subset on the lowest supported transformers (.ci/lowest.sh, in the
# verl venv). Each prints a timed header so CI's log says where the time went.
set -euo pipefail
cd "$(dirname "$0")/.."
for job in docs verl lowest; do
    start=$SECONDS
    echo "== .ci/$job.sh"
    bash ".ci/$job.sh"
    echo "== .ci/$job.sh passed in $((SECONDS - start)) s"
done

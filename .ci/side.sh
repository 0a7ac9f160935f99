#!/usr/bin/env bash
# .ci/run's background step, niced, while the main venv installs and its suite runs: the docs
# (.ci/docs.sh: a venv of its own, then the site built with warnings as errors), the verl venv
# (.ci/verl_venv.sh), then the tests on the lowest supported transformers in it (.ci/lowest.sh:
# single-process tests, so niced beside the suite they take what it leaves idle, its tail above all).
# The verl engine's tests are not run here: their torchrun ranks beside the main suite's multi-rank
# tests oversubscribe 2 cores (gloo ranks starve; measured: the whole run at 12% of the main suite after
# 13 min), so .ci/run runs them after the main suite.
set -euo pipefail
cd "$(dirname "$0")/.."
for job in docs verl_venv lowest; do
    start=$SECONDS
    echo "== .ci/$job.sh"
    bash ".ci/$job.sh"
    echo "== .ci/$job.sh passed in $((SECONDS - start)) s"
done

#!/usr/bin/env bash
# Docs: in a venv of their own (.venv-docs: the test environment stays exactly as the tests ran it),
# install the pinned `docs` extra of pyproject.toml (the tools only: mkdocstrings reads the sources
# statically, so neither the package nor torch is needed), then build the site with warnings as
# errors. Run from .ci/run; needs Python >= 3.11 (tomllib).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv-docs
. .venv-docs/bin/activate
reqs=$(mktemp)
trap 'rm -f "$reqs"' EXIT
python - "$reqs" <<'PY'
import sys, tomllib
with open("pyproject.toml", "rb") as f:
    docs = tomllib.load(f)["project"]["optional-dependencies"]["docs"]
open(sys.argv[1], "w").write("\n".join(docs) + "\n")
PY
. .ci/install.sh
ci_install -r "$reqs"
# NO_MKDOCS_2_WARNING: silences Material's banner about MkDocs 2.0 (a notice, not a build warning)
NO_MKDOCS_2_WARNING=1 python -m mkdocs build --strict --site-dir "${DOCS_SITE_DIR:-site}"

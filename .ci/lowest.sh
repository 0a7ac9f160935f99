#!/usr/bin/env bash
# CI for the lowest transformers version treetrain supports (pyproject.toml: the lower bound of
# `transformers`; the main venv tests the newest), in a venv of its own that sees the main test
# venv's packages (.venv-ci: torch and the rest, through a .pth file) and installs only transformers
# at the lower bound, with the hub and tokenizers versions it pins. A small subset: the model zoo's
# whole-mapping check and a few architectures (sliding windows in the mask only, longrope, Gated
# DeltaNet), the length-dependent rope cases and the sliding-window models.
set -euo pipefail
cd "$(dirname "$0")/.."
lowest=$(python3 - <<'PY'
import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
print(next(re.search(r">=([0-9.]+)", d).group(1) for d in deps if d.startswith("transformers")))
PY
)
shared=$(.venv-ci/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
python3 -m venv .venv-lowest
echo "$shared" > "$(.venv-lowest/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/ci.pth"
.venv-lowest/bin/python -m pip install -q "transformers==$lowest"
.venv-lowest/bin/python -c "import transformers; assert transformers.__version__ == '$lowest', transformers.__version__"
.venv-lowest/bin/python -m pytest -q -p no:cacheprovider tests/test_rope.py \
    tests/test_model_zoo.py::test_every_causal_lm_type_is_exact_or_refused_by_name \
    "tests/test_model_zoo.py::test_exact_architecture[llama]" \
    "tests/test_model_zoo.py::test_exact_architecture[qwen2_moe]" \
    "tests/test_model_zoo.py::test_exact_architecture[phi3]" \
    "tests/test_model_zoo.py::test_exact_architecture[qwen3_5_text]" \
    tests/test_sliding_window.py -k "not blocksparse and not triton and not flex"

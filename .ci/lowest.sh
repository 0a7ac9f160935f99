#!/usr/bin/env bash
# CI for the lowest transformers version treetrain supports (pyproject.toml's lower bound, which is
# the version verl 0.9.1 installs: .ci/verl.sh's venv has it, so this runs there, no install). The
# main venv tests the newest. A subset: the whole-mapping check (types verified only on the newest
# are refused by name here), every zoo type, the length-dependent rope cases and the sliding-window
# models, and the vision-language types verified on 5.10.
set -euo pipefail
cd "$(dirname "$0")/.."
lowest=$(python3 - <<'PY'
import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
print(next(re.search(r">=([0-9.]+)", d).group(1) for d in deps if d.startswith("transformers")))
PY
)
# a temp root of its own: it runs beside the main suite (.ci/side.sh)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
.venv-verl/bin/python -c "import transformers; assert transformers.__version__ == '$lowest', transformers.__version__"
.venv-verl/bin/python -m pytest -q -p no:cacheprovider --basetemp "$tmp/zoo" tests/test_rope.py tests/test_model_zoo.py \
    tests/test_sliding_window.py -k "not blocksparse and not triton and not flex"
# the vision-language types verified on 5.10 (support_vision.VISION_OLDER; ~40 s) and the whole
# mapping's refusals there
.venv-verl/bin/python -m pytest -q -p no:cacheprovider --basetemp "$tmp/vlm" tests/test_vlm_zoo.py \
    -k "every_vlm or qwen2_vl or qwen2_5_vl or qwen3_vl"

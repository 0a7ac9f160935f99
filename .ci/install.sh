# Sourced by the side venvs' scripts (.ci/docs.sh, .ci/verl_venv.sh), in an activated venv:
# `ci_install ARGS...` is `pip install ARGS...` done by uv (pip's resolver, downloads and byte-compiling
# run one file at a time: the verl venv took 939 s niced beside the suite; uv: 56 s, the same 147
# packages at the same versions as pip's). The main venv stays pip's, as the README installs it (uv
# resolved two of mlflow's dependencies differently there: python-dateutil 4.0.0, graphene 3.4).
# uv is given pip's own configuration (`pip config list`: find-links, extra indexes, constraints) and
# pip's choice among indexes (the best version of all, not the first index that has the package).
# Byte-compiled on purpose: these machines set PYTHONDONTWRITEBYTECODE=1, so every test process would
# otherwise compile torch and transformers from source. Where uv cannot be installed, pip does it.
ci_install() {
    if ! python -m pip install -q uv >/dev/null 2>&1; then
        python -m pip install -q "$@"
        return
    fi
    local flags=(--index-strategy unsafe-best-match --compile-bytecode --quiet) key value
    while IFS='=' read -r key value; do
        value=${value#\'}
        value=${value%\'}
        for v in $value; do
            case ${key##*.} in
            index-url) flags+=(--index-url "$v") ;;
            extra-index-url) flags+=(--extra-index-url "$v") ;;
            find-links) flags+=(--find-links "$v") ;;
            constraint) flags+=(--constraint "$v") ;;
            esac
        done
    done < <(python -m pip config list 2>/dev/null)
    python -m uv pip install --python "$(command -v python)" "${flags[@]}" "$@"
}

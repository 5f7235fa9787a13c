#!/usr/bin/env bash
# Installs the `export` extra of pyproject.toml -- the trainers' own configuration parsers that validate
# `stratagem export` (tests/test_trainer_parsers.py) -- into the active environment, without dependencies: the
# extra is a pinned closure (pyproject.toml says why), and torch must stay the build already installed.
set -euo pipefail
cd "$(dirname "$0")/.."
requirements="$(mktemp)"
trap 'rm -f "$requirements"' EXIT
python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['export']))" > "$requirements"
torch_before="$(python -c 'import torch; print(torch.__version__)')"
DS_BUILD_OPS=0 pip install -q --no-deps -r "$requirements"
torch_after="$(python -c 'import torch; print(torch.__version__)')"
if [ "$torch_before" != "$torch_after" ]; then
    echo "install_trainer_parsers.sh: torch changed from $torch_before to $torch_after" >&2
    exit 1
fi

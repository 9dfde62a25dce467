#!/usr/bin/env bash
# Create .venv and install megatrain_nb with what it needs. Idempotent.
#
#   bash scripts/setup.sh            # the package
#   bash scripts/setup.sh test       # the package and its test dependencies (any extras, comma-separated)
#   bash scripts/setup.sh lab        # with JupyterLab, the megatrain-nb sidebar (builds it: Node.js >= 20)
#                                    # and what the four notebooks need (TRL for notebook 04)
#
# PyTorch: a torch already in .venv (a CUDA build you installed, say) is kept. Otherwise, on a
# Linux/Windows machine without an NVIDIA GPU, torch comes from PyTorch's CPU wheel index, so no
# multi-GB CUDA build is pulled in; when that index cannot be reached, from pip's own index.
# With an NVIDIA GPU (nvidia-smi lists one) torch comes from pip's own index (the CUDA build).
# TORCH_INDEX_URL=... overrides the index; TORCH_SPEC=... the version ("torch==2.13.0").
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${1:-}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
CPU_INDEX="https://download.pytorch.org/whl/cpu"
T0=$SECONDS

step() { echo "[setup $((SECONDS - T0))s] $*"; }

# pip with one line per package it collects or installs (not ~95 s of silence); the full log
# is printed when pip fails. --no-compile: pip does not byte-compile every module of torch,
# transformers and JupyterLab at install time (minutes on 2 cores); Python compiles, and caches,
# only the modules a program imports, when it first imports them.
pip_install() {
  local log rc
  log=$(mktemp)
  set +e
  python -m pip install --no-compile --progress-bar off --disable-pip-version-check "$@" 2>&1 | tee "$log" |
    { grep --line-buffered -E '^(Collecting|Processing|Installing collected|Successfully installed|Requirement already satisfied: megatrain)' |
      sed -u 's/^/    /' || true; }
  rc=${PIPESTATUS[0]}
  set -e
  if [ "$rc" -ne 0 ]; then
    echo "    pip failed (exit $rc); its output:" >&2
    tail -n 40 "$log" >&2
  fi
  rm -f "$log"
  return "$rc"
}

has_nvidia_gpu() {
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'
}

index_reachable() {
  python - "$1" <<'EOF' >/dev/null 2>&1
import sys, urllib.request
urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=15).read(1)
EOF
}

if [ ! -x .venv/bin/python ]; then
  step "creating .venv with $(python3 --version 2>&1)"
  python3 -m venv .venv
else
  step "using the existing .venv"
fi
. .venv/bin/activate
step "upgrading pip"
python -m pip install -q --disable-pip-version-check --upgrade pip

if python -c "import torch" 2>/dev/null; then
  step "keeping the installed $(python -c 'import torch; c = torch.version.cuda; print(f"torch {torch.__version__}" + (f" (CUDA {c})" if c else " (CPU build)"))')"
elif [ -n "${TORCH_INDEX_URL:-}" ]; then
  step "installing $TORCH_SPEC from TORCH_INDEX_URL=$TORCH_INDEX_URL"
  pip_install "$TORCH_SPEC" --index-url "$TORCH_INDEX_URL"
elif has_nvidia_gpu || [ "$(uname -s)" = "Darwin" ]; then
  # An NVIDIA GPU wants the CUDA build (pip's index); macOS wheels on PyPI are CPU-only anyway.
  step "installing $TORCH_SPEC from pip's index ($(has_nvidia_gpu && echo 'NVIDIA GPU found: CUDA build' || echo macOS); a large download)"
  pip_install "$TORCH_SPEC"
elif index_reachable "$CPU_INDEX"; then
  step "no NVIDIA GPU: installing $TORCH_SPEC, CPU build, from $CPU_INDEX (about 200 MB)"
  pip_install "$TORCH_SPEC" --index-url "$CPU_INDEX"
else
  step "no NVIDIA GPU, but $CPU_INDEX cannot be reached: installing $TORCH_SPEC from pip's index" \
       "(on Linux that may be the multi-GB CUDA build; set TORCH_INDEX_URL to a mirror of the CPU index to avoid it)"
  pip_install "$TORCH_SPEC"
fi

step "installing megatrain-nb${EXTRAS:+[$EXTRAS]} (editable) and its dependencies: transformers, datasets, jupyter, ..."
pip_install -e ".${EXTRAS:+[$EXTRAS]}"

# `jlpm install` with what needs reading only: yarn's informational lines (YN0000 steps and
# summary, YN0013 "can't be found in the cache and will be fetched" once per package, YN0007/8
# "must be built", YN0019, YN0085) are left out, every other code (a peer dependency that does
# not match, a lockfile that would change, an error) is printed; its whole output on failure.
jlpm_install() {
  local log rc
  log=$(mktemp)
  set +e
  (cd extension && jlpm install --immutable) >"$log" 2>&1
  rc=$?
  set -e
  { grep -E 'YN[0-9]{4}' "$log" | grep -vE 'YN00(00|07|08|13|19|85):' | sed 's/^/    /'; } || true
  if [ "$rc" -ne 0 ]; then
    echo "    jlpm install failed (exit $rc); its output:" >&2
    tail -n 40 "$log" >&2
  fi
  rm -f "$log"
  return "$rc"
}

# `setup.sh lab`: the JupyterLab sidebar. Its frontend is built once from extension/ with
# Node.js >= 20 (installing a released wheel never needs Node.js: it carries the build).
# SKIP_LAB_BUILD=1: the lab extra's packages without the build (scripts/test.sh: extension/ci.sh
# builds the sidebar from a clean copy of extension/ and hands that build over, one build, not two).
if [ "${SKIP_LAB_BUILD:-0}" = 1 ]; then
  step "SKIP_LAB_BUILD=1: the megatrain-nb sidebar is not built here"
elif [[ ",$EXTRAS," == *,lab,* ]] && [ ! -f extension/megatrain_nb_lab/labextension/package.json ]; then
  node_major=$(node --version 2>/dev/null | sed -E 's/^v([0-9]+).*/\1/' || true)
  if [ -n "$node_major" ] && [ "$node_major" -ge 20 ]; then
    step "building the JupyterLab extension with Node.js $(node --version) (jlpm install, jlpm build:prod; a few minutes)"
    jlpm_install && (cd extension && jlpm build:prod 2>&1 | { grep -v '^[[:space:]]*$' || true; } | tail -n 2 |
                     sed 's/^/    /')
    step "reinstalling so that the installed package carries the built extension"
    pip_install --no-deps -e .
  else
    step "Node.js >= 20 not found (${node_major:+found v$node_major}): JupyterLab and the rest are installed, the" \
         "megatrain-nb sidebar is not; install Node.js >= 20 and run bash scripts/setup.sh lab again"
  fi
fi
step "done: $(python -c 'import torch, megatrain_nb; print("megatrain-nb", getattr(megatrain_nb, "__version__", "?"), "with torch", torch.__version__)') in .venv (activate: . .venv/bin/activate)"

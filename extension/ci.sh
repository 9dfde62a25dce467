#!/usr/bin/env bash
# CI for the JupyterLab integration (extension/, megatrain_nb/lab/, tests/lab/).
#
#   bash extension/ci.sh            # from anywhere; uses the python on PATH (the project venv)
#
# 1. Debian's chromium for the browser test (Playwright's own browser download is not used).
# 2. Builds the megatrain_nb_lab wheel from a clean copy of extension/ (only the files a
#    checkout has: no node_modules, lib or prebuilt labextension) and checks that the wheel
#    holds the prebuilt labextension and the server-extension config.
# 3. Installs that wheel into a fresh venv whose PATH has no Node.js and checks that
#    `jupyter labextension list` reports megatrain-nb-lab enabled and OK.
# 4. Installs the wheel into the current environment; checks the server extension.
# 5. jest (panel logic), pytest tests/lab (beacon, handlers), then the browser test.
#
# Environment: PYTHON (default: python), SKIP_BROWSER=1 to leave out step 1 and the e2e test,
# LABEXTENSION_INTO=DIR to keep a copy of the labextension built in step 2 there.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python}
DIST="$ROOT/extension/dist"
STAGE=$(mktemp -d /tmp/megatrain-nb-lab-ci.XXXXXX)
trap 'rm -rf "$STAGE"' EXIT
cd "$ROOT"

T0=$SECONDS
step() { printf '\n=== [%ss] %s\n' "$((SECONDS - T0))" "$*"; }
. "$ROOT/extension/wheel_checks.sh"   # check_wheel, check_no_node_install, strip_ansi

if [ "${SKIP_BROWSER:-0}" != 1 ] && ! [ -x /usr/bin/chromium ]; then
  step "installing Debian chromium"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium
fi

step "python test and build tools"
"$PY" -m pip install -q --no-compile playwright "pytest-jupyter[server]>=0.9" pytest-timeout build \
  "hatchling>=1.21" "jupyterlab>=4.2,<5" "hatch-nodejs-version>=0.3.2" "hatch-jupyter-builder>=0.9"

step "wheel from a clean copy of extension/"
mkdir -p "$STAGE/src" "$DIST"
# tracked files plus new, not ignored ones: exactly what a checkout of this tree contains
git ls-files -z --cached --others --exclude-standard -- extension \
  | (cd "$ROOT" && xargs -0 cp --parents -t "$STAGE/src")
test ! -e "$STAGE/src/extension/node_modules" && test ! -e "$STAGE/src/extension/megatrain_nb_lab/labextension"
rm -f "$DIST"/megatrain_nb_lab-*.whl
# built with this environment's build tools (the ones extension/pyproject.toml requires, installed
# above; `build` checks that they satisfy it), not in a fresh isolated environment that would
# download and install JupyterLab once more for the build alone
"$PY" -m build --wheel --no-isolation --outdir "$DIST" "$STAGE/src/extension"
WHEEL=$(ls "$DIST"/megatrain_nb_lab-*.whl)
check_wheel "$WHEEL"
# LABEXTENSION_INTO=DIR: that build, copied to DIR (scripts/test.sh: extension/megatrain_nb_lab/
# labextension, which megatrain-nb's own install carries), so that it is not built a second time
if [ -n "${LABEXTENSION_INTO:-}" ]; then
  rm -rf "$LABEXTENSION_INTO.tmp" && cp -r "$STAGE/src/extension/megatrain_nb_lab/labextension" "$LABEXTENSION_INTO.tmp"
  rm -rf "$LABEXTENSION_INTO" && mv "$LABEXTENSION_INTO.tmp" "$LABEXTENSION_INTO"
  echo "the build copied to $LABEXTENSION_INTO"
fi

step "fresh venv without Node.js: jupyter labextension list"
check_no_node_install "$STAGE" "$WHEEL"

step "install the wheel here; server extension"
"$PY" -m pip install -q --force-reinstall --no-deps "$WHEEL"
jupyter labextension list 2>&1 | strip_ansi | grep -E 'megatrain-nb-lab v[0-9.]+ enabled +OK'
SERVER=$(jupyter server extension list 2>&1 | strip_ansi | grep -A2 'megatrain_nb.lab')
echo "$SERVER"
echo "$SERVER" | grep -q 'megatrain_nb.lab  *OK'

step "jest: panel logic"
(cd "$STAGE/src/extension" && jlpm test --ci)

# The Python tests (tests/lab, including the browser test) run with the rest of the suite in
# scripts/test.sh; run them alone with:  python -m pytest tests/lab
if [ "${RUN_LAB_TESTS:-0}" = 1 ]; then
  step "pytest: beacon, server handlers, browser"
  "$PY" -m pytest -q -p no:cacheprovider tests/lab -rs
fi

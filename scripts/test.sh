#!/usr/bin/env bash
# Install everything the tests need, then run the whole test suite. Exits non-zero on failure.
#
#   bash scripts/test.sh [pytest args]
#
# Needs: Python 3.10+ and network access to the package indexes; for the JupyterLab part,
# Node.js >= 20 (to build the extension; SKIP_LAB=1 leaves that out) and root for
# `apt-get install chromium` (without chromium the browser tests are skipped, with one line
# saying so; SKIP_BROWSER=1 leaves chromium and the browser tests out). How long it takes: the
# README's Quick start.
#
# What it installs, said before it is done: .venv (scripts/setup.sh, with JupyterLab and the
# megatrain-nb sidebar built); as root, Debian's chromium system-wide (apt-get); the sidebar's own
# wheel (megatrain_nb_lab), which extension/ci.sh installs to check it and this script removes
# again, so that megatrain-nb alone owns the sidebar in `jupyter labextension list`.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "[test] $*"; }
lab=1
if [ "${SKIP_LAB:-0}" = 1 ] || ! [ -f extension/ci.sh ]; then
  lab=0
fi
if [ "$lab" = 1 ]; then
  major=$(node --version 2>/dev/null | sed -E 's/^v([0-9]+).*/\1/' || true)
  if [ -z "$major" ] || [ "$major" -lt 20 ]; then
    echo "[test] error: building the JupyterLab extension needs Node.js >= 20 (found: ${major:-none})." \
         "Install it, or run SKIP_LAB=1 bash scripts/test.sh" >&2
    exit 2
  fi
  # the lab extra's packages; the sidebar is built once, by extension/ci.sh below from a clean copy
  # of extension/, which hands the build to megatrain-nb (its one owner)
  SKIP_LAB_BUILD=1 bash scripts/setup.sh test,lab
else
  bash scripts/setup.sh test
fi
. .venv/bin/activate
if [ "$lab" = 0 ]; then
  say "SKIP_LAB=1: not building the JupyterLab extension"
else
  if [ "${SKIP_BROWSER:-0}" != 1 ] && ! [ -x /usr/bin/chromium ]; then
    if [ "$(id -u)" = 0 ]; then
      say "installing Debian's chromium system-wide (apt-get, as root) for the browser tests;" \
          "SKIP_BROWSER=1 leaves it and them out"
    else
      say "chromium is missing and installing it needs root: the browser tests will be skipped"
      export SKIP_BROWSER=1
    fi
  fi
  say "building and checking the JupyterLab extension (extension/ci.sh; a few minutes): it installs" \
      "playwright, pytest-jupyter, build and hatchling into .venv, and the megatrain_nb_lab wheel it" \
      "checks (removed again below)"
  LABEXTENSION_INTO=extension/megatrain_nb_lab/labextension bash extension/ci.sh
  say "removing the megatrain_nb_lab wheel extension/ci.sh installed; megatrain-nb keeps the sidebar"
  python -m pip uninstall -y -q megatrain_nb_lab
  # megatrain-nb again, now carrying the sidebar extension/ci.sh built (its labextension files);
  # with this environment's setuptools when it is new enough (no isolated build environment made)
  iso=()
  if python -c 'import setuptools, sys; sys.exit(int(setuptools.__version__.split(".")[0]) < 77)' 2>/dev/null; then
    iso=(--no-build-isolation)
  fi
  python -m pip install -q --no-deps --force-reinstall --no-compile --disable-pip-version-check ${iso[@]+"${iso[@]}"} -e .
  jupyter labextension list 2>&1 | sed -E 's/\x1b\[[0-9;]*m//g' | grep -E 'megatrain-nb-lab v[0-9.]+ enabled' | sed 's/^/    /' || {
    echo "[test] error: after removing megatrain_nb_lab, megatrain-nb's own sidebar is not listed" >&2
    exit 1
  }
fi
# no path given: tests/conftest.py runs the suite in two processes (pytest-xdist)
say "running the test suite: python -m pytest -q --durations=25 $*"
python -m pytest -q --durations=25 "$@"
# The whole suite plans by the planner's rules (tests/conftest.py); a user's engines plan by this
# machine's measured rates once `megatrain-nb machine` has run. The engine's memory and parity tests
# pass both ways (issue 45): measured into a temporary cache, never the user's.
if [ $# -eq 0 ]; then
  rates=$(mktemp -d)
  say "the engine's memory and parity tests again, planned by rates measured now (megatrain-nb machine," \
      "~25 s, into $rates)"
  MEGATRAIN_NB_CACHE="$rates" megatrain-nb machine --device cpu | tail -n 1
  # in two processes as the suite is (files named: tests/conftest.py leaves the worker count to -n)
  MEGATRAIN_NB_TEST_RATES="$rates" python -m pytest -q -n "${MEGATRAIN_NB_TEST_WORKERS:-2}" --dist loadgroup \
    -m "not slow" tests/engine/test_measured_pass.py \
    tests/engine/test_engine.py tests/engine/test_window_memory.py tests/engine/test_parity.py tests/engine/test_tiers.py
  rm -rf "$rates"
fi

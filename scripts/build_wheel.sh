#!/usr/bin/env bash
# Build the megatrain-nb wheel with the prebuilt JupyterLab extension inside it, and prove that
# installing it needs no Node.js:
#
#   bash scripts/build_wheel.sh          # needs Node.js >= 20 and jupyterlab (for jlpm) to build
#
# 1. builds the labextension in extension/ (jlpm install, jlpm build:prod) unless already built;
# 2. builds the wheel (MEGATRAIN_NB_REQUIRE_LABEXTENSION=1: no wheel without the extension);
# 3. checks the wheel holds share/jupyter/labextensions/megatrain-nb-lab (package.json,
#    static/remoteEntry.*.js, install.json) and the server-extension config;
# 4. installs it (with --no-deps beside jupyterlab) into a fresh venv whose PATH has no Node.js
#    and checks `jupyter labextension list` reports megatrain-nb-lab enabled and OK.
# Environment: PYTHON (default: python). The wheel lands in dist/.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python}
STAGE=$(mktemp -d /tmp/megatrain-nb-wheel.XXXXXX)
trap 'rm -rf "$STAGE"' EXIT
cd "$ROOT"
step() { printf '\n=== %s\n' "$*"; }
strip_ansi() { sed -e 's/\x1b\[[0-9;]*m//g'; }

step "labextension (Node.js $(node --version 2>/dev/null || echo missing))"
if [ ! -f extension/megatrain_nb_lab/labextension/package.json ]; then
  (cd extension && jlpm install --immutable && jlpm build:prod)
fi

step "wheel"
rm -f dist/megatrain_nb-*.whl
MEGATRAIN_NB_REQUIRE_LABEXTENSION=1 "$PY" -m pip wheel --no-deps --no-build-isolation -w dist .
WHEEL=$(ls dist/megatrain_nb-*.whl)
"$PY" - "$WHEEL" <<'EOF'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
ext = [n for n in names if "/share/jupyter/labextensions/megatrain-nb-lab/" in n]
missing = [x for x in ("package.json", "install.json") if not any(n.endswith("megatrain-nb-lab/" + x) for n in ext)]
assert not missing, f"wheel lacks {missing}"
assert any("/static/remoteEntry." in n for n in ext), "no static/remoteEntry.*.js in the wheel"
assert any(n.endswith("etc/jupyter/jupyter_server_config.d/megatrain_nb.json") for n in names)
print(f"{sys.argv[1]}: the prebuilt labextension ({len(ext)} files) and the server-extension config")
EOF

step "fresh venv without Node.js: jupyter labextension list"
"$PY" -m venv "$STAGE/venv"
mkdir -p "$STAGE/bin-no-node"
"$STAGE/venv/bin/python" -m pip install -q jupyterlab
"$STAGE/venv/bin/python" -m pip install -q --no-deps "$WHEEL"
LIST=$(env -i HOME="$STAGE" PATH="$STAGE/venv/bin:$STAGE/bin-no-node" \
  "$STAGE/venv/bin/jupyter" labextension list 2>&1 | strip_ansi)
echo "$LIST"
if env -i PATH="$STAGE/venv/bin:$STAGE/bin-no-node" /bin/sh -c 'command -v node'; then
  echo "node is reachable in the no-node PATH" >&2; exit 1
fi
echo "$LIST" | grep -Eq 'megatrain-nb-lab v[0-9.]+ enabled +OK'
echo "OK: $WHEEL carries the JupyterLab extension; installing it needed no Node.js"

# Checks shared by extension/ci.sh (the megatrain_nb_lab wheel) and scripts/build_wheel.sh (the
# megatrain-nb wheel, which carries the same labextension). Source it; needs $PY.

strip_ansi() { sed -e 's/\x1b\[[0-9;]*m//g'; }

# check_wheel WHEEL: it holds the prebuilt labextension and the server-extension config.
check_wheel() {
  "$PY" - "$1" <<'EOF'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
ext = [n for n in names if "/share/jupyter/labextensions/megatrain-nb-lab/" in n]
need = ["package.json", "static/style.js", "install.json"]
missing = [x for x in need if not any(n.endswith("megatrain-nb-lab/" + x) for n in ext)]
assert not missing, f"wheel lacks {missing}: {names}"
assert any("/static/remoteEntry." in n for n in ext), "no remoteEntry.*.js in the wheel"
assert any(n.endswith("etc/jupyter/jupyter_server_config.d/megatrain_nb.json") for n in names)
print(f"{sys.argv[1]}: prebuilt labextension with {len(ext)} files")
EOF
}

# check_no_node_install STAGE WHEEL [PIP ARGS]: installed with jupyterlab into a fresh venv whose
# PATH has no Node.js, `jupyter labextension list` reports megatrain-nb-lab enabled and OK.
check_no_node_install() {
  local stage=$1 wheel=$2 list
  shift 2
  "$PY" -m venv "$stage/venv"
  mkdir -p "$stage/bin-no-node"   # PATH = the venv only: no node, npm or jlpm reachable
  "$stage/venv/bin/python" -m pip install -q jupyterlab
  "$stage/venv/bin/python" -m pip install -q "$@" "$wheel"
  list=$(env -i HOME="$stage" PATH="$stage/venv/bin:$stage/bin-no-node" \
    "$stage/venv/bin/jupyter" labextension list 2>&1 | strip_ansi)
  echo "$list"
  if env -i PATH="$stage/venv/bin:$stage/bin-no-node" /bin/sh -c 'command -v node'; then
    echo "node is reachable in the no-node PATH" >&2; return 1
  fi
  echo "$list" | grep -Eq 'megatrain-nb-lab v[0-9.]+ enabled +OK'
}

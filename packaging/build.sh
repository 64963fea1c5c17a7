#!/usr/bin/env bash
# Build dist/activator: one self-contained executable (PyInstaller --onefile) that runs
# on a VM with no Python installed.
#
# Usage: packaging/build.sh              build dist/activator (from any directory)
#        packaging/build.sh --print-excludes   list the modules left out, one a line
# Environment:
#   PYTHON   interpreter for a new build venv (default python3); used only when the
#            repository has no .venv yet
#   VENV     build venv to use or create (default <repo>/.venv)
#
# The binary links against the build host's glibc: build on the oldest distro you
# deploy to. Builds are reproducible: SOURCE_DATE_EPOCH is the last commit's time and
# PYTHONHASHSEED is 0, so the same tree gives the same bytes.
set -euo pipefail

# Modules PyInstaller would otherwise drag in: gevent's test suite, setuptools, and
# stdlib tools nothing at run time needs (tests/test_packaging.py imports every activator
# module with these blocked, so a new import of one of them fails a test, not a VM).
# gevent.libuv and cffi: the default loop is libev's Cython one (stack.md section 6).
EXCLUDES=(
  gevent.tests gevent.testing
  setuptools pkg_resources
  test unittest doctest pydoc
  tkinter lib2to3
  gevent.libuv cffi psutil
)

if [ "${1:-}" = "--print-excludes" ]; then
  printf '%s\n' "${EXCLUDES[@]}"
  exit 0
fi
if [ $# -gt 0 ]; then
  echo "usage: $0 [--print-excludes]" >&2
  exit 2
fi

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

DEMO="$ROOT/config/demo.yaml"
if [ ! -f "$DEMO" ]; then
  echo "build.sh: $DEMO is missing (activator demo needs it)" >&2
  exit 1
fi

VENV=${VENV:-"$ROOT/.venv"}
if [ ! -x "$VENV/bin/python" ]; then
  echo "==> creating build venv $VENV"
  "${PYTHON:-python3}" -m venv "$VENV"
fi
PY="$VENV/bin/python"

echo "==> installing activator and its build tools into $VENV"
"$PY" -m pip install --quiet --disable-pip-version-check -e "$ROOT[build]"

# Reproducibility: fixed hash seed, and every timestamp PyInstaller writes taken from
# the last commit (1980-01-01, the earliest a zip can hold, outside a git checkout).
export PYTHONHASHSEED=0
SOURCE_DATE_EPOCH=$(git -C "$ROOT" log -1 --format=%ct 2>/dev/null || true)
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-315532800}

exclude_args=()
for module in "${EXCLUDES[@]}"; do
  exclude_args+=(--exclude-module "$module")
done

echo "==> building dist/activator (SOURCE_DATE_EPOCH=$SOURCE_DATE_EPOCH)"
rm -rf "$ROOT/build/pyinstaller" "$ROOT/dist/activator"
"$PY" -m PyInstaller \
  --noconfirm --clean --log-level WARN \
  --onefile --strip \
  --name activator \
  --paths "$ROOT" \
  --distpath "$ROOT/dist" \
  --workpath "$ROOT/build/pyinstaller" \
  --specpath "$ROOT/build/pyinstaller" \
  --add-data "$DEMO:config" \
  --collect-data activator \
  "${exclude_args[@]}" \
  "$ROOT/packaging/entry.py" \
  2>&1 | { grep -v -E 'Hidden import "gevent\.(tests|testing|libuv)[."]' || true; }
# (PyInstaller's gevent hook lists its test and libuv modules as hidden imports, which
# we exclude: a hundred harmless "not found" warnings, filtered out above.)

BIN="$ROOT/dist/activator"
# Smoke test: the frozen interpreter starts and the CLI answers.
version=$("$BIN" --version)
bytes=$(stat -c %s "$BIN")
echo "==> built $BIN: $version, $bytes bytes ($(( (bytes + 524288) / 1048576 )) MiB), sha256 $(sha256sum "$BIN" | cut -d' ' -f1)"

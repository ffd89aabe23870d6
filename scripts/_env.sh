# Sourced by scripts/*: a project virtualenv in .venv with the package and its extras.
# Reinstalls only when pyproject.toml changed, so repeated runs start at once.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON_BIN="${PYTHON:-python3}"
EXTRAS="${LEASES_EXTRAS:-dev}"
stamp=".venv/.installed-$(sha1sum pyproject.toml | cut -c1-12)-${EXTRAS//,/_}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON_BIN" -m venv .venv
fi
if [ ! -f "$stamp" ]; then
  echo "installing django-leases[$EXTRAS] into .venv ..." >&2
  .venv/bin/python -m pip install --quiet --upgrade pip >/dev/null
  .venv/bin/python -m pip install --quiet -e ".[$EXTRAS]"
  rm -f .venv/.installed-*
  touch "$stamp"
fi
export PATH="$PWD/.venv/bin:$PATH"

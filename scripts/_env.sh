# Sourced by scripts/*: a project virtualenv in .venv with the package (editable), its extras and
# the development dependency groups of pyproject.toml (PEP 735).
# LEASES_EXTRAS (default binary,redis,celery,drf) and LEASES_GROUPS (default dev) choose them.
# Reinstalls only when pyproject.toml or the choice changed, so repeated runs start at once.
# It leaves the caller's shell options alone (the install runs in a strict subshell): a developer
# who sources it by hand keeps a shell where a failing pipeline does not end what follows. The
# scripts set their own `set -euo pipefail`.
cd "$(dirname "${BASH_SOURCE[0]}")/.." || return 1
(
set -euo pipefail
PYTHON_BIN="${PYTHON:-python3}"
EXTRAS="${LEASES_EXTRAS:-binary,redis,celery,drf}"
DEV_GROUPS="${LEASES_GROUPS:-dev}"
stamp=".venv/.installed-$(sha1sum pyproject.toml | cut -c1-12)-${EXTRAS//,/_}-${DEV_GROUPS//,/_}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON_BIN" -m venv .venv
fi
if [ ! -f "$stamp" ]; then
  echo "installing django-leases[$EXTRAS] and groups $DEV_GROUPS into .venv ..." >&2
  # `--group` needs pip >= 25.1; a fresh venv may come with an older one.
  .venv/bin/python -m pip install --quiet --upgrade "pip>=25.1" >/dev/null
  group_args=()
  for group in ${DEV_GROUPS//,/ }; do group_args+=(--group "$group"); done
  .venv/bin/python -m pip install --quiet -e ".[$EXTRAS]" "${group_args[@]}"
  rm -f .venv/.installed-*
  touch "$stamp"
fi
) || return 1
export PATH="$PWD/.venv/bin:$PATH"

# side_venv VENV PYTHON PIP_ARGS...: a virtualenv beside .venv for the checks on other versions
# (scripts/check-floors, scripts/check-django), made with PYTHON and holding the package
# (editable) with every extra, the test group and PIP_ARGS (the pins); made again only when
# PYTHON, the pins or pyproject.toml changed.
side_venv() {
  local venv="$1" base="$2"
  shift 2
  local stamp
  stamp="$venv/.installed-$(printf '%s\n' "$base" "$@" "$(sha1sum pyproject.toml)" | sha1sum | cut -c1-12)"
  [ -f "$stamp" ] && return 0
  echo "installing the package with $* into $venv ($base)"
  rm -rf "$venv"
  "$base" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --upgrade "pip>=25.1" >/dev/null
  "$venv/bin/python" -m pip install --quiet \
    -e ".[binary,redis,celery,drf,prometheus,opentelemetry,health,zookeeper,etcd]" \
    --group test "$@"
  touch "$stamp"
}

# Sourced by scripts/test and scripts/demo: make the venv if it is missing and install the
# project into it (building the C extension). Idempotent. $VENV names the venv (default .venv)
# and $PYTHON the interpreter that makes it (default python3.11).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="${VENV:-.venv}"
py="${PYTHON:-python3.11}"
command -v "$py" >/dev/null 2>&1 || py=python3
if [ ! -x "$venv/bin/python" ]; then
    echo "+ creating $venv with $py"
    "$py" -m venv "$venv"
fi
extras="${1:-}"
spec="."
[ -n "$extras" ] && spec=".[$extras]"
# Reinstall only when the build inputs changed since the last install, or when
# extras are asked for that the last install did not include.
stamp="$venv/.shmshare-install-$(cat pyproject.toml setup.py native/* | sha1sum | cut -c1-16)"
have_extras() { [ -f "$stamp" ] && { [ -z "$extras" ] || grep -qx "$extras" "$stamp"; }; }
if ! have_extras || ! "$venv/bin/python" -c 'import shmshare._native' 2>/dev/null; then
    echo "+ installing shmshare${extras:+ [$extras]} into $venv"
    "$venv/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
    # compat: a path in a .pth, which mypy (and a checkout's parent directory) sees as the package,
    # where the default editable finder is an import hook that mypy cannot follow
    "$venv/bin/python" -m pip install -q -e "$spec" --config-settings editable_mode=compat
    [ -f "$stamp" ] || { rm -f "$venv"/.shmshare-install-*; : > "$stamp"; }
    [ -z "$extras" ] || echo "$extras" >> "$stamp"
fi

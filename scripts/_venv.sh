# Sourced by the scripts in this folder: makes sure .venv/ exists at the repo root,
# built with a Python >= 3.12 (mitmproxy 12 needs it), and up to date with the
# pinned requirements. Sets REPO and VENV_PY. Prints progress to stderr only.

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$REPO/.venv"
VENV_PY="$VENV/bin/python"
MIN_PY="3.12"

_py_ok() {  # is "$1" a runnable Python >= MIN_PY?
    "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1
}

find_python() {
    local cand
    if [ -n "${RELAY_PYTHON:-}" ]; then
        _py_ok "$RELAY_PYTHON" && { echo "$RELAY_PYTHON"; return 0; }
        echo "RELAY_PYTHON=$RELAY_PYTHON is not a Python >= $MIN_PY" >&2; return 1
    fi
    # pyenv shims exist for versions that are installed but not selected, and fail
    # when run: _py_ok runs each candidate rather than trusting `command -v`.
    for cand in python3.14 python3.13 python3.12 python3; do
        command -v "$cand" >/dev/null 2>&1 && _py_ok "$cand" && { command -v "$cand"; return 0; }
    done
    local root="${PYENV_ROOT:-$HOME/.pyenv}"
    command -v pyenv >/dev/null 2>&1 && root="$(pyenv root)"
    for cand in $(ls -d "$root"/versions/3.* 2>/dev/null | sort -rV); do
        _py_ok "$cand/bin/python3" && { echo "$cand/bin/python3"; return 0; }
    done
    cat >&2 <<MSG
ttft-relay needs Python >= $MIN_PY (mitmproxy 12 does) and found none:
  looked for python3.14/3.13/3.12/python3 on PATH and in pyenv versions.
Install one (e.g. 'pyenv install 3.12', or your distribution's python3.12 package),
or point RELAY_PYTHON at it.
MSG
    return 1
}

ensure_venv() {
    local reqs="${1:-requirements.txt}" stamp="$VENV/.installed" want
    want="$reqs:$(cat "$REPO"/requirements*.txt "$REPO/constraints.txt" | sha256sum | cut -c1-16)"
    if [ -x "$VENV_PY" ] && _py_ok "$VENV_PY" && grep -qxF "$want" "$stamp" 2>/dev/null; then
        ensure_bytecode
        return 0
    fi
    # The systemd unit runs as its own user over a read-only checkout (ProtectSystem=strict): a
    # .venv a `git pull` left behind is rebuilt by the checkout's owner, not by a start. 78: the
    # unit fails with this message instead of restarting into the same wall.
    if ! [ -w "$REPO" ] || { [ -e "$VENV" ] && ! [ -w "$VENV" ]; }; then
        cat >&2 <<MSG
[ttft-relay] $VENV is not up to date with $reqs (a git pull changed the requirements?)
and $(id -un) cannot rebuild it here (the checkout is read-only to it). As the checkout's
owner, rebuild it and start again:
  sudo $REPO/scripts/relay --version
MSG
        exit 78
    fi
    if ! [ -x "$VENV_PY" ] || ! _py_ok "$VENV_PY"; then
        local py; py="$(find_python)" || exit 1
        echo "[ttft-relay] creating .venv with $("$py" --version 2>&1) ($py)" >&2
        rm -rf "$VENV"
        "$py" -m venv "$VENV" || { echo "[ttft-relay] python -m venv failed" >&2; exit 1; }
    fi
    echo "[ttft-relay] installing $reqs into .venv" >&2
    "$VENV_PY" -m pip install -q --disable-pip-version-check \
        -r "$REPO/$reqs" -c "$REPO/constraints.txt" >&2 || {
        echo "[ttft-relay] pip install failed (see above)" >&2; exit 1; }
    # The dev set includes the runtime set, so a dev install satisfies both stamps. (An `if`,
    # not `[ ... ] && echo`: as the last command that would make the function fail under
    # `set -e` whenever the test is false, and every script's first run with it.)
    echo "$want" > "$stamp"
    if [ "$reqs" = requirements-dev.txt ]; then
        echo "requirements.txt:${want#*:}" >> "$stamp"
    fi
    ensure_bytecode
}

ensure_bytecode() {  # the package's bytecode written for the starts that cannot write it
    # The systemd unit and the image run the relay as a user that cannot write the checkout:
    # without this, each of their starts compiled the package's ~150 modules again, in the
    # supervisor and in every worker (0.2-0.7 s of a start, docs/benchmarks.md). Whoever can
    # write it (README step 2 and the upgrade, as root; the Dockerfile) writes it here, once per
    # change: a stamp older than any source says when. The stamp is taken before the compile,
    # so a file changed meanwhile is compiled the next time.
    local pkg="$REPO/ttft_relay" stamp="$REPO/ttft_relay/__pycache__/.compiled"
    [ -w "$pkg" ] || return 0
    if [ -e "$stamp" ] && [ -z "$(find "$pkg" -name '*.py' -newer "$stamp" -print -quit)" ]; then
        return 0
    fi
    mkdir -p "$pkg/__pycache__" 2>/dev/null && touch "$stamp.new" 2>/dev/null || return 0
    if "$VENV_PY" -m compileall -q "$pkg" >/dev/null 2>&1; then
        mv "$stamp.new" "$stamp"
    else  # a file that does not compile: its import says why
        rm -f "$stamp.new"
    fi
}

ttft_relay_command() {  # runs `ttft-relay "$@"` from this checkout, in .venv
    PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" exec "$VENV_PY" -m ttft_relay "$@"
}

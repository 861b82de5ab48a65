# Sourced by scripts/test: the system programs the end-to-end tests drive as real parts —
# Prometheus (metrics scraped for real), Chromium (pages a person looks at), nginx (the
# benchmarks' reference setup) — installed from Debian's packages when missing, where we are
# root with apt-get (CI, a fresh VPS or container). Elsewhere nothing is installed and those
# tests skip, each saying which program it lacks. TTFT_RELAY_NO_INSTALL=1 turns the install
# off. scripts/bench asks for its own programs (`ensure_system_packages nginx:nginx`).
# apt-get runs under flock on /tmp/ttft-apt.lock, so that parallel runs on one machine take
# dpkg's lock in turn.

SYSTEM_PACKAGES=(prometheus:prometheus chromium:chromium nginx:nginx)
# program:package pairs (the default of ensure_system_packages; it takes others as arguments)

ensure_system_packages() {
    local pair missing=()
    [ $# -gt 0 ] || set -- "${SYSTEM_PACKAGES[@]}"
    for pair in "$@"; do
        command -v "${pair%%:*}" >/dev/null 2>&1 || missing+=("${pair#*:}")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    if [ -n "${TTFT_RELAY_NO_INSTALL:-}" ] || [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
        echo "[ttft-relay] not installing ${missing[*]} (needs root and apt-get; TTFT_RELAY_NO_INSTALL unset): their tests skip" >&2
        return 0
    fi
    echo "[ttft-relay] installing ${missing[*]} (Debian packages)" >&2
    { flock 9 && apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"; } \
        9>>/tmp/ttft-apt.lock >/tmp/ttft-relay-apt.log 2>&1 \
        || echo "[ttft-relay] apt-get install ${missing[*]} failed (see /tmp/ttft-relay-apt.log): their tests skip" >&2
}

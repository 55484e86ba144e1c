#!/usr/bin/env bash
# Prints the path of a Chromium for tests/test_serve_browser.py, installing Debian's `chromium`
# package when none is there (as root, through apt-get: no browser download from elsewhere).
# Exit 0: the path is on stdout. Exit 3: there is none and none can be installed here (why, on stderr).
set -euo pipefail

find_browser() {
    command -v chromium || command -v chromium-browser || true
}

browser=$(find_browser)
if [[ -z $browser ]]; then
    if [[ $(id -u) != 0 ]]; then
        echo "chromium is not installed, and installing it needs root: sudo apt-get install chromium" >&2
        exit 3
    fi
    if ! command -v apt-get >/dev/null; then
        echo "chromium is not installed, and this system has no apt-get to install it with" >&2
        exit 3
    fi
    log=$(mktemp)
    trap 'rm -f "$log"' EXIT
    echo "installing Debian's chromium with apt-get..." >&2
    if ! { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium; } \
            >"$log" 2>&1; then
        echo "apt-get install chromium failed: $(tail -n 1 "$log")" >&2
        exit 3
    fi
    browser=$(find_browser)
fi
echo "$browser"

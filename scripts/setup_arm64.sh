#!/usr/bin/env bash
# Builds an emulated aarch64 Linux Python for ember's edge tests and prints the command prefix that runs it:
#   qemu-aarch64-static -cpu max -L ROOT ROOT/opt/venv/bin/python3
# (append a script and its arguments). Needs no binfmt_misc registration and no chroot:
#   1. Debian packages it uses, installed with apt-get when missing (as root): qemu-user-static, debootstrap,
#      g++-aarch64-linux-gnu (the cross linker `ember compile --target <aarch64 preset>` uses).
#   2. `debootstrap --foreign --arch=arm64` downloads Debian bookworm's arm64 python3 and its dependencies
#      (the first stage runs nothing foreign); every downloaded .deb is then unpacked with `dpkg-deb -x`
#      (no maintainer scripts run: python3 needs none to start).
#   3. `python3 -m venv --without-pip` runs under qemu; the host's pip downloads the aarch64 wheels
#      (REQUIREMENTS below) and installs them, --no-index, into that venv's site-packages (no pip under
#      emulation, so no certificate or speed trouble there).
# Cached under ${EMBER_CACHE:-~/.cache/ember}/arm64/<key>/, key = hash of this script; built under a temporary
# name and renamed at the end, so an interrupted build never looks finished. Run it again: it prints at once.
# Exit 0: the prefix is on stdout. Exit 3: it cannot be set up here (one line on stderr saying why).
set -euo pipefail

REQUIREMENTS=(apache-tvm==0.27.0.post1 apache-tvm-ffi==0.1.14.post0 numpy ml_dtypes tokenizers jinja2)
DEBIAN_PACKAGES=(qemu-user-static debootstrap g++-aarch64-linux-gnu)
SUITE=bookworm
PYTHON_VERSION=3.11

fail() { echo "setup_arm64.sh: $*" >&2; exit 3; }

key=$(sha256sum "${BASH_SOURCE[0]}" | cut -c1-16)
cache=${EMBER_CACHE:-$HOME/.cache/ember}/arm64
root=$cache/$key
prefix="qemu-aarch64-static -cpu max -L $root $root/opt/venv/bin/python3"

if [[ -f $root/.complete ]]; then
    echo "$prefix"
    exit 0
fi

missing=()
for package in "${DEBIAN_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
done
if ((${#missing[@]})); then
    [[ $(id -u) == 0 ]] || fail "needs root to install ${missing[*]}: sudo apt-get install ${missing[*]}"
    command -v apt-get >/dev/null || fail "${missing[*]} missing and there is no apt-get to install them with"
    log=$(mktemp)
    echo "installing ${missing[*]} with apt-get..." >&2
    if ! { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
            "${missing[@]}"; } >"$log" 2>&1; then
        fail "apt-get install ${missing[*]} failed: $(tail -n 1 "$log")"
    fi
    rm -f "$log"
fi

mkdir -p "$cache"
building=$(mktemp -d "$cache/.building-XXXXXX")
log=$building.log
trap 'rm -rf "$building" "$log"' EXIT

echo "debootstrap --foreign arm64 $SUITE (downloads python3 and its dependencies)..." >&2
if ! debootstrap --foreign --arch=arm64 --variant=minbase --include=python3,python3-venv \
        "$SUITE" "$building/root" http://deb.debian.org/debian >"$log" 2>&1; then
    fail "debootstrap --foreign --arch=arm64 failed: $(tail -n 1 "$log")"
fi
for deb in "$building"/root/var/cache/apt/archives/*.deb; do
    dpkg-deb -x "$deb" "$building/root"
done
rm -f "$building"/root/var/cache/apt/archives/*.deb
run_foreign() { qemu-aarch64-static -cpu max -L "$building/root" "$@"; }
run_foreign "$building/root/usr/bin/python$PYTHON_VERSION" -c "import sys; assert sys.version_info[:2] == (3, 11)" \
    || fail "the arm64 python$PYTHON_VERSION does not start under qemu-aarch64-static"
venv=$building/root/opt/venv
run_foreign "$building/root/usr/bin/python$PYTHON_VERSION" -m venv --without-pip "$venv" >"$log" 2>&1 \
    || fail "python -m venv under qemu failed: $(tail -n 1 "$log")"
# The venv names the root's temporary path: point it at the root's final path, with relative links to python.
sed -i "s|^home = .*|home = $root/usr/bin|" "$venv/pyvenv.cfg"
for link in python python3 "python$PYTHON_VERSION"; do
    ln -sfn "../../../usr/bin/python$PYTHON_VERSION" "$venv/bin/$link"
done

echo "downloading aarch64 wheels: ${REQUIREMENTS[*]}..." >&2
platform_args=(--only-binary=:all: --platform manylinux_2_28_aarch64 --platform manylinux2014_aarch64
    --platform manylinux_2_17_aarch64 --python-version "$PYTHON_VERSION" --implementation cp)
if ! python3 -m pip download -q "${platform_args[@]}" -d "$building/wheels" "${REQUIREMENTS[@]}" >"$log" 2>&1; then
    fail "pip download of the aarch64 wheels failed: $(tail -n 1 "$log")"
fi
if ! python3 -m pip install -q --no-index --find-links "$building/wheels" "${platform_args[@]}" --no-compile \
        --target "$venv/lib/python$PYTHON_VERSION/site-packages" "${REQUIREMENTS[@]}" >"$log" 2>&1; then
    fail "installing the aarch64 wheels into the venv failed: $(tail -n 1 "$log")"
fi
rm -rf "$building/wheels"

rm -rf "$root"
mv "$building/root" "$root"
check="import tvm_ffi, numpy, tokenizers, jinja2, ml_dtypes, platform; assert platform.machine() == 'aarch64'"
TVM_USE_RUNTIME_LIB=1 $prefix -c "$check" >"$log" 2>&1 \
    || { rm -rf "$root"; fail "the arm64 venv does not import its packages: $(tail -n 1 "$log")"; }
touch "$root/.complete"
echo "$prefix"

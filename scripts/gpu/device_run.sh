#!/usr/bin/env bash
# On the GPU machine, from the repository root, with .vship/ carried (scripts/gpu/build_vllm_payload.sh
# made it here):
#
#   bash scripts/gpu/device_run.sh
#
# Unpacks vLLM and the wheels the machine's image lacks, makes parkway importable without installing it
# (its image has no network to install parkway's own dependencies), builds the tiny model, and runs
# scripts/gpu/vllm_gpu_check.py: vLLM's kernels, then parkway's engine path in bf16 and in fp32.
# Results in $OUT: vllm_gpu.json (one record per stage), log.txt, log_<stage>.txt.
#
# PYTHON (default python3) must be the image's Python 3.12, where torch and transformers are; the
# payload's compiled modules are for 3.12. VLLM_PAYLOAD (default .vship) and VLLM_GPU_WORK (default
# /tmp/vllm-gpu, unpacked here) move the two folders. Without a GPU it stops at the first stage.
set -u
cd "$(dirname "$0")/../.."
repo=$(pwd)
python=${PYTHON:-python3}
payload=${VLLM_PAYLOAD:-.vship}
work=${VLLM_GPU_WORK:-/tmp/vllm-gpu}
export OUT=${OUT:-$work/out}
export PYTHONUNBUFFERED=1
started=$(date +%s)
elapsed() { echo "$(($(date +%s) - started)) s"; }
mkdir -p "$OUT"

"$python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' || {
  echo "device_run: $python is $("$python" -V 2>&1), the payload is for Python 3.12"
  exit 2
}
(cd "$payload" && sha256sum -c --ignore-missing SHA256SUMS) || {
  echo "device_run: $payload is damaged or incomplete: run scripts/gpu/build_vllm_payload.sh again"
  exit 2
}

site=$work/site
rm -rf "$site" && mkdir -p "$site"
for archive in "$payload/site.tar.xz" "$payload/fa3.tar.xz"; do
  [ -f "$archive" ] || continue  # fa3.tar.xz is optional
  # Python's tarfile when the image has no xz binary for tar to call
  tar -C "$site" -xJf "$archive" 2>/dev/null \
    || "$python" -c 'import sys, tarfile
tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="fully_trusted")' "$archive" "$site" \
    || { echo "device_run: cannot unpack $archive"; exit 3; }
done
echo "unpacked in $(elapsed): $(du -sh "$site" | cut -f1)"

# parkway's three folders are installed as parkway.actors, .protocol, .brokers: a link tree gives them
# those names without pip (as scripts/gates does).
names=$work/names
rm -rf "$names" && mkdir -p "$names/parkway"
for folder in actors protocol brokers; do ln -s "$repo/$folder" "$names/parkway/$folder"; done
export PYTHONPATH=$site:$names
# offline, no usage reports, no compile step (VllmEngine sets the same for itself): here for the
# tiny-model build and the kernels stage too
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TORCH_COMPILE_DISABLE=1
export VLLM_NO_USAGE_STATS=1 VLLM_DO_NOT_TRACK=1

command -v "$python"
"$python" -V
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader \
  || echo "device_run: no nvidia-smi"

export CHECK_MODEL=$work/tiny
"$python" -c 'import sys
from pathlib import Path
from parkway.actors.engines.tiny_model import build_tiny_model
build_tiny_model(Path(sys.argv[1]))' "$CHECK_MODEL" >"$OUT/log_tiny_model.txt" 2>&1 || {
  cat "$OUT/log_tiny_model.txt"
  exit 4
}
rm -f "$OUT/log_tiny_model.txt"
echo "tiny model built at $(elapsed)"

"$python" scripts/gpu/vllm_gpu_check.py 2>&1 | tee "$OUT/log.txt"
status=${PIPESTATUS[0]}
echo "device_run: total $(elapsed), check exited $status"
exit "$status"

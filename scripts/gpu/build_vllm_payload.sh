#!/usr/bin/env bash
# Builds .vship/: what the GPU machine needs to run parkway's real vLLM engine path and cannot fetch
# itself (its image has Python 3.12, torch 2.11.0+cu130 and transformers, but no vLLM and no network).
# The device tool carries at most 64 MiB, so vLLM's 300 MB wheel is cut to what a dense model on a
# Hopper GPU uses. Run it here, on any Linux with network to PyPI: it needs python3 with pip 22.1 or
# newer (any Python: nothing is built or run, the wheels are only unpacked for 3.12), xz, tar, git.
#
#   bash scripts/gpu/build_vllm_payload.sh          then, on the GPU machine: bash scripts/gpu/device_run.sh
#
# .vship/ holds:
#   site.tar.xz   vLLM 0.26.0 (trimmed, its kernel library pruned to sm_90) and the wheels the image
#                 lacks, as one `pip install --target` tree
#   fa3.tar.xz    vLLM's FlashAttention-3 library alone (the bf16 attention backend on Hopper); optional:
#                 without it bf16 runs on the Triton attention backend
#   SHA256SUMS    of both, which device_run.sh checks before unpacking
# The wheels are downloaded into build/vllm-payload/ (kept: a rebuild downloads nothing) and checked
# against the sha256 in scripts/gpu/vllm-payload-wheels.txt.
set -euo pipefail
cd "$(dirname "$0")/../.."

pins=scripts/gpu/vllm-payload-wheels.txt
work=build/vllm-payload
wheels=$work/wheels
site=$work/site
fa3=$work/fa3
ship=.vship
budget_bytes=$((64 << 20))
# Every tag the pinned files carry: older pips match --platform exactly (23.2 does not take a
# manylinux_2_17 wheel for manylinux_2_28), and llguidance 1.7.6 exists only as manylinux_2_31.
target=(--only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64)

say() { echo "build_vllm_payload: $*" >&2; }
# pip, less one line of this machine's noise: an index location in its config that does not exist
pip() {
  python3 -m pip --disable-pip-version-check "$@" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }

for tool in python3 xz tar git sha256sum; do
  command -v "$tool" >/dev/null || { say "needs $tool on PATH"; exit 1; }
done
python3 -m pip --version >/dev/null 2>&1 || { say "needs pip for python3 (python3 -m ensurepip)"; exit 1; }

say "downloading the pinned wheels into $wheels (each checked against its sha256)"
mkdir -p "$wheels"
pip download --quiet --no-deps --require-hashes -r "$pins" "${target[@]}" -d "$wheels"
say "wheels: $(mib "$(du -cb "$wheels"/*.whl | tail -1 | cut -f1)")"

# --target with --python-version/--platform unpacks the wheels as Python 3.12 would, with whichever
# python3 runs pip here; --no-compile because bytecode from this interpreter would be for the wrong
# Python. --no-index: only the files just checked. No advice against installing as root: nothing here
# installs into an environment.
say "installing them for Python 3.12 into $site"
rm -rf "$site" "$fa3"
pip install --quiet --no-index --find-links "$wheels" --no-deps --require-hashes -r "$pins" \
  "${target[@]}" --target "$site" --no-compile --no-cache-dir --root-user-action=ignore
say "installed: $(mib "$(du -sb "$site" | cut -f1)")"

# What a dense text model on sm_90 never loads. vLLM imports each of these under try/except, or only
# for the models, GPUs or options that need it; removing one that is needed shows up on the device as
# an ImportError or a missing-file error in that stage's log.
vllm=$site/vllm
drop() {
  local path
  for path in "$@"; do
    [ -e "$path" ] || { say "expected $path in vLLM 0.26.0; has the pin changed?"; exit 1; }
    rm -rf "$path"
  done
}
drop "$vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so"   # FlashAttention-2 (305 MB); Hopper uses FA3
drop "$vllm/vllm-rs"                               # the Rust frontend, only with VLLM_USE_RUST_FRONTEND=1
drop "$vllm/_moe_C_stable_libtorch.abi3.so"        # mixture-of-experts kernels
drop "$vllm/_flashmla_C.abi3.so" "$vllm/_flashmla_extension_C.abi3.so"   # MLA attention (DeepSeek)
drop "$vllm/_qutlass_C.abi3.so"                    # FP4 quantisation
drop "$vllm/third_party/fmha_sm100"                # Blackwell (sm_100) sparse attention
drop "$vllm/third_party/deep_gemm/include"         # DeepGEMM (FP8 GEMM): its JIT headers ...
find "$vllm/third_party/deep_gemm" -name '*.so' -delete   # ... and its compiled module, per Python
rm -rf "$site/bin"                                  # console scripts, with this machine's python3
say "trimmed: $(mib "$(du -sb "$site" | cut -f1)")"

python3 scripts/gpu/prune_fatbin.py "$vllm/_C_stable_libtorch.abi3.so" 90

mkdir -p "$fa3/vllm/vllm_flash_attn"
mv "$vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so" "$fa3/vllm/vllm_flash_attn/"

say "packing into $ship/ (xz -9e, a few minutes)"
rm -rf "$ship"
mkdir -p "$ship"
pack() {  # fixed order, owner and times: the same tree packs to the same bytes
  tar -C "$1" --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -cf - . | xz -9e -T0 >"$2"
}
pack "$site" "$ship/site.tar.xz"
pack "$fa3" "$ship/fa3.tar.xz"
(cd "$ship" && sha256sum site.tar.xz fa3.tar.xz >SHA256SUMS)

# What one device call carries: the working tree (tracked and untracked, not ignored), shared/ where
# there is one, and .vship/.
payload_bytes=$(du -cb "$ship"/* | tail -1 | cut -f1)
tree_bytes=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
shared_bytes=0
[ -d shared ] && shared_bytes=$(du -sb shared | cut -f1)
carried=$((payload_bytes + tree_bytes + shared_bytes))
for file in "$ship"/*; do
  printf '  %-22s %s\n' "$file" "$(mib "$(stat -c %s "$file")")"
done
echo "payload $(mib "$payload_bytes") + working tree $(mib "$tree_bytes") + shared/ $(mib "$shared_bytes")" \
  "= $(mib "$carried") carried, of $(mib "$budget_bytes")"
if [ "$carried" -ge "$budget_bytes" ]; then
  fa3_bytes=$(stat -c %s "$ship/fa3.tar.xz")
  echo "OVER the device tool's budget by $(mib $((carried - budget_bytes)))."
  if [ $((carried - fa3_bytes)) -lt "$budget_bytes" ]; then
    echo "Without $ship/fa3.tar.xz it fits (bf16 then runs on the Triton attention backend):"
    echo "  rm $ship/fa3.tar.xz && (cd $ship && sed -i '/fa3.tar.xz/d' SHA256SUMS)"
  fi
  exit 1
fi
echo "fits: carry [\"$ship\"] and run bash scripts/gpu/device_run.sh"

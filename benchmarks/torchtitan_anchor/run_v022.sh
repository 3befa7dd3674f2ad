#!/usr/bin/env bash
# torchtitan v0.2.2 anchor: our 1B shape, seq 8192, local batch 2, 30 steps, compile
# (model+loss), no AC, bf16 mixed precision, one GPU; native (no FSDP) then FSDP2.
# Run from the repo root:  bash benchmarks/torchtitan_anchor/run_v022.sh   (offline, once the kit is built)
# Env knobs: TT_TIMEOUT (s per variant, default 240), TT_VARIANTS ("native fsdp2"),
#            TT_EXTRA (extra torchtitan CLI overrides, e.g. "--training.steps 40").
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
TIMEOUT=${TT_TIMEOUT:-240}
VARIANTS=${TT_VARIANTS:-"native fsdp2"}
# shellcheck source=setup_kit.sh
source benchmarks/torchtitan_anchor/setup_kit.sh "torchtitan v0.2.2"
export PYTHONPATH=$KIT/v022:$SITE${PYTHONPATH:+:$PYTHONPATH} TORCHINDUCTOR_CACHE_DIR=/tmp/tt_inductor_v022

python3 - <<'EOF' || { echo "torchtitan v0.2.2: preflight import failed"; exit 1; }
import torch, datasets, tyro, torchdata, tokenizers
try:
    import triton; tv = triton.__version__
except ImportError:
    tv = "MISSING"
print(f"preflight: torch {torch.__version__} triton {tv} datasets {datasets.__version__} "
      f"tyro {tyro.__version__} tokenizers {tokenizers.__version__}; "
      f"gpu {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'NONE'}")
EOF

declare -A SUMMARY
for v in $VARIANTS; do
  log=/tmp/tt_v022_$v.log
  case $v in
    native) force=0 ;;
    fsdp2)  force=1 ;;
    *) echo "unknown variant $v"; continue ;;
  esac
  echo "=== torchtitan v0.2.2 $v (timeout ${TIMEOUT}s, log $log)"
  t0=$(date +%s)
  # shellcheck disable=SC2086
  TT_FORCE_FSDP=$force timeout -k 15 "$TIMEOUT" python3 "$HERE/launch_v022.py" \
    --job.config_file "$HERE/v022_1b.toml" \
    --job.dump_folder /tmp/tt_v022_out_$v \
    --model.hf_assets_path $ASSETS/tokenizer \
    --training.dataset_path $ASSETS/c4_test \
    ${TT_EXTRA:-} > "$log" 2>&1
  rc=$?
  echo "rc=$rc after $(( $(date +%s) - t0 ))s"
  grep -E "Applied FSDP|handled by (AMP|fully_shard)|Compiling|size: .* total parameters|anchor kit" "$log" \
    | sed -E 's/\x1b\[[0-9;]*m//g; s/^.* - (INFO|WARNING) - //' | sort -u | head -8
  grep -E "step: *[0-9]+ " "$log" | sed -E 's/\x1b\[[0-9;]*m//g; s/^.* - INFO - //; s/ +/ /g'
  if [ $rc -ne 0 ]; then echo "--- last 30 log lines:"; tail -n 30 "$log"; fi
  SUMMARY[$v]=$(python3 "$HERE/summarize.py" "$log" "torchtitan v0.2.2 $v" 11 30)
  if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then cp "$log" "$OUT/" 2>/dev/null; fi
done

echo "=== summary"
for v in $VARIANTS; do [ -n "${SUMMARY[$v]:-}" ] && echo "${SUMMARY[$v]}"; done

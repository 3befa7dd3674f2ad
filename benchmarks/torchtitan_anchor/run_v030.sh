#!/usr/bin/env bash
# torchtitan 0.3.0 (PyPI wheel) attempt at the same 1B single-GPU run, to put its
# failure on torch 2.11 on record.  At most TT030_BUDGET seconds (default 150) in all.
# Run from the repo root:  bash benchmarks/torchtitan_anchor/run_v030.sh
# Attempts, each with what is left of the budget, stopping at the first that trains:
#   A "as released"   : --module tt030_cfg --config llama3_1b_ours (CUDA graphs on, spmd_types)
#   B "import shim"   : + stand-in torch.distributed.fsdp.DataParallelMeshDims,
#                       --parallelism.spmd_backend partial_dtensor (no dp_mesh_dims kwarg)
#   C "shim, no graphs": B + --training.disable_cuda_graphs
# 0.3.0 differs from our model only where it must: FlexAttention (it rejects SDPA for
# LMs), fused wqkv, and FSDP2 always applied (even on 1 GPU).
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
BUDGET=${TT030_BUDGET:-150}
SITE030=/tmp/tt_site030     # torchtitan 0.3.0 + spmd_types + torch_checkpointing
# shellcheck source=setup_kit.sh
source benchmarks/torchtitan_anchor/setup_kit.sh "torchtitan 0.3.0"
rm -rf "$SITE030"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE030" "$KIT"/wheels030/*.whl \
  || { echo "torchtitan 0.3.0: wheel install failed"; exit 1; }
# 0.3.0 first; tt030_cfg and the common deps after; never the v0.2.2 tree
export PYTHONPATH=$SITE030:$HERE:$SITE${PYTHONPATH:+:$PYTHONPATH} TORCHINDUCTOR_CACHE_DIR=/tmp/tt_inductor_v030
python3 -c "import torch, torchtitan, importlib.metadata as m; print('torch', torch.__version__, '| torchtitan', m.version('torchtitan'), 'from', torchtitan.__file__)"

BASE=(--module tt030_cfg --config llama3_1b_ours
      --hf-assets-path $ASSETS/tokenizer --dataloader.dataset-path $ASSETS/c4_test
      --dump-folder /tmp/tt_v030_out)
t_start=$(date +%s)
final=""
for attempt in A B C; do
  left=$(( BUDGET - ($(date +%s) - t_start) ))
  if [ $left -lt 25 ]; then echo "=== attempt $attempt skipped: ${left}s of the ${BUDGET}s budget left"; break; fi
  case $attempt in
    A) shim=0; extra=(); what="as released" ;;
    B) shim=1; extra=(--parallelism.spmd-backend partial_dtensor); what="import shim + partial_dtensor" ;;
    C) shim=1; extra=(--parallelism.spmd-backend partial_dtensor --training.disable-cuda-graphs); what="import shim + partial_dtensor + no CUDA graphs" ;;
  esac
  log=/tmp/tt_v030_$attempt.log
  echo "=== torchtitan 0.3.0 attempt $attempt ($what), timeout ${left}s, log $log"
  t0=$(date +%s)
  TT030_SHIM=$shim timeout -k 10 "$left" python3 "$HERE/launch_v030.py" "${BASE[@]}" "${extra[@]}" > "$log" 2>&1
  rc=$?
  echo "rc=$rc after $(( $(date +%s) - t0 ))s"
  grep -E "step: *[0-9]+ " "$log" | sed -E 's/\x1b\[[0-9;]*m//g; s/^.* - INFO - //' | tail -n 12
  if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then cp "$log" "$OUT/" 2>/dev/null; fi
  if [ $rc -eq 0 ] || grep -qE "step: *1[0-9] " "$log"; then
    final=$(python3 "$HERE/summarize.py" "$log" "torchtitan 0.3.0 ($what)" 11 30); break
  fi
  echo "--- last 30 lines of attempt $attempt:"
  grep -vE "^\s*$" "$log" | tail -n 30
  final="torchtitan 0.3.0: FAILED (last attempt $attempt: $what, rc=$rc; error: $(grep -E '^(\[rank0\]: )?[A-Za-z_.]*(Error|Exception)[A-Za-z]*:' "$log" | tail -n 1 | sed -E 's/^\[rank0\]: //' | cut -c1-220))"
done
echo "=== summary"
echo "$final"

#!/usr/bin/env bash
# The single-GPU speed and memory rows of issue #28, in parts that each fit one device call (< 600 s), from the repo
# root on the GPU machine, with jsonargparse and torchao importable (carried wheels), for `anchor` and `v030` the
# torchtitan kit built (benchmarks/torchtitan_anchor/build_kit.sh) and carried as .tt, and for `fa4` the
# flash-attn-4 package importable (`benchmarks/fa4_kit.sh`: two calls carry it). One lease, for example:
#   bash benchmarks/single_gpu_acceptance.sh anchor 1b 32k
#   bash benchmarks/single_gpu_acceptance.sh anchor 1b 32k float8   # or every H200 row but FA4's in one call
#   bash benchmarks/single_gpu_acceptance.sh fa4 8b
#   bash benchmarks/single_gpu_acceptance.sh graphs short launches v030
# Each run is bounded with `timeout -k` (the bounds are for hangs; a part takes about a third to half of its
# bound): a process that ignores SIGTERM is killed, and the next part still runs.
# Full logs go to $OUT (or /tmp) as <part>.log; the output keeps the table rows and summary lines.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
logs=${OUT:-/tmp}
start=$(date +%s)
bounded() { local limit=$1; shift; timeout -k 10 "$limit" "$@"; }
rows() { grep -E "^\| (1B|8B)|rror|^torchtitan|passed|failed|GPU busy" | grep -v "^E " | tail -"${1:-4}"; }
throughput() { bounded "$1" python3 benchmarks/throughput.py "${@:2}" 2>&1 | tee -a "$logs/$part.log" | rows "${keep:-2}"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for part in "$@"; do
  echo "=== $part (t=$(( $(date +%s) - start ))s)"
  case $part in
    graphs)  # GPU correctness of cuda_graphs: plain loops, refusals, Lightning with accumulation and validation
      bounded 360 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py > "$logs/$part.log" 2>&1
      rows 6 < "$logs/$part.log" ;;
    anchor)  # torchtitan v0.2.2, native single GPU, same shape
      TT_VARIANTS=native TT_TIMEOUT=150 bash benchmarks/torchtitan_anchor/run_v022.sh > "$logs/$part.log" 2>&1
      rows 2 < "$logs/$part.log" ;;
    1b)  # the 1B step through Lightning with SDPA: eager (and the plain loop), then with CUDA graphs
      common=(--flavor 1B --compile --compile-loss --steps 20 --warmup 8)
      throughput 110 "${common[@]}" --reference
      throughput 100 "${common[@]}" --cuda-graphs ;;
    fa4)  # the same with FlashAttention-4, then with float8 tensorwise linears too (the best kernels), and the plain
      # loop for the Lightning / plain ratio (benchmarks/RESULTS.md: 'Best kernels')
      common=(--flavor 1B --compile --compile-loss --steps 20 --warmup 8 --attention-kernel fa4)
      throughput 100 "${common[@]}"
      throughput 110 "${common[@]}" --float8 tensorwise --reference ;;
    float8)  # the best kernels without FA4 (a lease of one call): float8 tensorwise linears with SDPA, 1B and 8B x 16
      throughput 100 --flavor 1B --compile --compile-loss --steps 20 --warmup 8 --float8 tensorwise
      throughput 110 --flavor 8B --n-layers 16 --batch-size 1 --compile --compile-loss --steps 12 --warmup 5 \
        --float8 tensorwise ;;
    short)  # a step 8x shorter (seq 2048, batch 1: ~35 ms), where the host's launches may show: eager, then graphs
      common=(--flavor 1B --seq-len 2048 --batch-size 1 --compile --compile-loss --steps 30 --warmup 10)
      throughput 100 "${common[@]}"
      throughput 100 "${common[@]}" --cuda-graphs ;;
    launches)  # is the host's launching (TritonAdamW: ~146 kernels a step) hidden behind the GPU? 3 profiled steps
      common=(--flavor 1B --compile --compile-loss --steps 12 --warmup 6 --profile --reference) keep=3
      throughput 100 "${common[@]}"
      throughput 100 "${common[@]}" --cuda-graphs ;;
    8b)  # 8B width x 16 layers at 8k: bf16 and float8 tensorwise, then float8 with FA4 where it is importable
      common=(--flavor 8B --n-layers 16 --batch-size 1 --compile --compile-loss --steps 12 --warmup 5)
      throughput 110 "${common[@]}"
      throughput 110 "${common[@]}" --float8 tensorwise
      if python3 -c "from titan_strategy.kernels.flash_attention4 import flash_attention4_installed as installed
raise SystemExit(not installed())" 2>/dev/null; then
        throughput 110 "${common[@]}" --float8 tensorwise --attention-kernel fa4
      fi ;;
    profile)  # where the 1B SDPA step's GPU time goes now: the kernel table of 3 profiled Lightning steps (in the log)
      common=(--flavor 1B --compile --compile-loss --steps 12 --warmup 6 --profile) keep=3
      throughput 100 "${common[@]}" ;;
    loss)  # the chunked loss's row kernel against inductor's kernels, then the whole loss both ways
      bounded 150 python3 benchmarks/loss_chunk.py > "$logs/$part.log" 2>&1
      tail -13 "$logs/$part.log" ;;
    kernels)  # the RoPE and RMSNorm kernels against inductor's kernels at the 1B step's shapes
      bounded 120 python3 benchmarks/layer_kernels.py > "$logs/$part.log" 2>&1
      tail -12 "$logs/$part.log" ;;
    lastbatch)  # the 1B step with graphs, then a short last batch (which the Llama plan pads, so it replays too)
      common=(--flavor 1B --compile --compile-loss --steps 12 --warmup 5 --cuda-graphs)
      throughput 100 "${common[@]}"
      throughput 120 "${common[@]}" --short-last-batch ;;
    agreement)  # what the ranks' agreement on each graphed call costs the host (gloo processes on this machine)
      for ranks in 2 8; do bounded 120 python3 benchmarks/capture_agreement.py --ranks "$ranks" --calls 2000; done ;;
    batch4)  # the 1B step at batch 4: the plain loss (full-vocabulary logits), then the chunked one (the default)
      common=(--flavor 1B --batch-size 4 --compile --compile-loss --steps 14 --warmup 6)
      throughput 120 "${common[@]}" --cross-entropy logits
      throughput 120 "${common[@]}" ;;
    32k)  # 8B width x 16 layers at 32k with full AC: bf16, then float8 tensorwise (it fits an 80 GB card;
      # benchmarks/RESULTS.md: '32k context')
      common=(--flavor 8B --n-layers 16 --batch-size 1 --compile --compile-loss --seq-len 32768
              --activation-checkpointing full --steps 12 --warmup 4)
      throughput 150 "${common[@]}"
      throughput 150 "${common[@]}" --float8 tensorwise ;;
    v030)  # torchtitan 0.3.0 on this torch, for the record
      TT030_BUDGET=60 bash benchmarks/torchtitan_anchor/run_v030.sh > "$logs/$part.log" 2>&1
      rows 2 < "$logs/$part.log" ;;
    *) echo "unknown part $part (graphs, anchor, 1b, fa4, float8, short, launches, profile, loss, kernels, lastbatch, agreement, batch4, 8b, 32k, v030)" ;;
  esac
done
echo "=== done (t=$(( $(date +%s) - start ))s)"

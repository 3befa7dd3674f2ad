#!/usr/bin/env bash
# The single-GPU speed and memory rows of issue #28, in parts that each fit one device call (< 600 s), from the repo
# root on the GPU machine, with jsonargparse and torchao importable (carried wheels) and, for `anchor` and `v030`,
# the torchtitan kit built (benchmarks/torchtitan_anchor/build_kit.sh) and carried as .tt:
#   bash benchmarks/single_gpu_acceptance.sh graphs anchor      # first call
#   bash benchmarks/single_gpu_acceptance.sh 1b 8b v030         # second call, same lease (32k needs an H200)
#   bash benchmarks/single_gpu_acceptance.sh launches           # "GPU busy X ms of Y ms wall", eager and graphed
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
      bounded 450 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py > "$logs/$part.log" 2>&1
      rows 6 < "$logs/$part.log" ;;
    anchor)  # torchtitan v0.2.2, native single GPU, same shape
      TT_VARIANTS=native TT_TIMEOUT=150 bash benchmarks/torchtitan_anchor/run_v022.sh > "$logs/$part.log" 2>&1
      rows 2 < "$logs/$part.log" ;;
    1b)  # the 1B step through Lightning: eager and with CUDA graphs, then FA4 where installed
      common=(--flavor 1B --compile --compile-loss --steps 20 --warmup 8)
      throughput 110 "${common[@]}" --reference
      throughput 100 "${common[@]}" --cuda-graphs
      throughput 90 "${common[@]}" --attention-kernel fa4 --cuda-graphs ;;
    launches)  # is the host's launching (TritonAdamW: ~146 kernels a step) hidden behind the GPU? 3 profiled steps
      common=(--flavor 1B --compile --compile-loss --steps 12 --warmup 6 --profile --reference) keep=3
      throughput 100 "${common[@]}"
      throughput 100 "${common[@]}" --cuda-graphs ;;
    8b)  # 8B width x 16 layers: bf16 and float8 tensorwise at 8k, full AC at 32k (over 80 GB: an H200)
      common=(--flavor 8B --n-layers 16 --batch-size 1 --compile --compile-loss)
      throughput 110 "${common[@]}" --steps 12 --warmup 5
      throughput 110 "${common[@]}" --float8 tensorwise --steps 12 --warmup 5
      throughput 150 "${common[@]}" --seq-len 32768 --activation-checkpointing full --steps 5 --warmup 2 ;;
    v030)  # torchtitan 0.3.0 on this torch, for the record
      TT030_BUDGET=60 bash benchmarks/torchtitan_anchor/run_v030.sh > "$logs/$part.log" 2>&1
      rows 2 < "$logs/$part.log" ;;
    *) echo "unknown part $part (graphs, anchor, 1b, launches, 8b, v030)" ;;
  esac
done
echo "=== done (t=$(( $(date +%s) - start ))s)"

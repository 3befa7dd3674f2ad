#!/usr/bin/env bash
# The multi-GPU validation run (issue #9), on the GPUs of one host:
#   1. Llama 3 8B, FSDP over all GPUs: compile + selective AC, then + float8, then + CUDA graphs; and a short
#      step (1B, 2k tokens a GPU) eager and with CUDA graphs, whose graphs hold FSDP's collectives
#   2. 2-D FSDP x TP2, without and with AsyncTP
#   3. PP=4 with FSDP: 1F1B, Interleaved1F1B, ZBVZeroBubble
#   4. CP=2/4/8 on the 8B shape, seq 64k -> 256k (and CP=1 at 32k), full AC
#   5. a NCCL hang drill: one rank skips a collective; the Flight Recorder dumps, titan-fr names it
#   6. async checkpoint under NCCL: blocking time per save, sync against async_pinned
#
#   bash benchmarks/multigpu.sh              # every case that fits the GPUs present
#   NGPU=4 bash benchmarks/multigpu.sh       # a subset of them
#   SMOKE=1 bash benchmarks/multigpu.sh      # 8-block models, few steps: checks the script, measures nothing
#
# Steps are bounded and each case has a wall-clock limit. A case that needs more GPUs than present is
# listed as skipped; one that fails is listed as failed with its log, and the run goes on. The table
# at the end is what goes into benchmarks/RESULTS.md.
set -uo pipefail
cd "$(dirname "$0")/.."

# NVLink multicast stays off (NVLS, symmetric-memory multicast, NVSHMEM's): see the device notes.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 OMP_NUM_THREADS=4
NGPU="${NGPU:-$(nvidia-smi --list-gpus | wc -l)}"
SMOKE="${SMOKE:-0}"
CASE_LIMIT_S="${CASE_LIMIT_S:-900}"
out="$(mktemp -d /tmp/multigpu.XXXXXX)"
results="$out/results.jsonl"
echo "multigpu.sh: $NGPU GPUs, logs in $out"

if [ "$SMOKE" = 1 ]; then
    shape=(--n-layers 8) steps=(--steps 11 --window 5)
else
    shape=() steps=(--steps 30 --window 5)
fi

skip() {  # name, why
    echo "{\"case\": \"$1\", \"skipped\": \"$2\"}" >>"$results"
}

train() {  # name, GPUs needed, then multigpu.py arguments
    local name="$1" need="$2"; shift 2
    if [ "$NGPU" -lt "$need" ]; then skip "$name" "needs $need GPUs"; return; fi
    echo "== $name"
    if timeout "$CASE_LIMIT_S" python benchmarks/multigpu.py --case "$name" --devices "$need" "${shape[@]}" \
            "${steps[@]}" "$@" >"$out/$name.log" 2>&1; then
        grep '^RESULT ' "$out/$name.log" | cut -c8- >>"$results"
    else
        echo "{\"case\": \"$name\", \"failed\": \"exit $?, see $out/$name.log\"}" >>"$results"
        tail -5 "$out/$name.log"
    fi
}

compiled='"compile": true, "compile_loss": true'
all="$NGPU"
two_or_all=$((NGPU >= 2 ? NGPU : 2))

# 1. 8B, FSDP over every GPU, local batch 1 (torchtitan's published 8B runs are on 8 GPUs).
train fsdp-8b-bf16 "$all" --flavor 8B --batch-size 1 \
    --strategy "{$compiled, \"activation_checkpointing\": \"selective_op\"}"
train fsdp-8b-float8 "$all" --flavor 8B --batch-size 1 \
    --strategy "{$compiled, \"activation_checkpointing\": \"selective_op\", \"float8\": \"tensorwise\"}"
# CUDA graphs under FSDP2 (never run on more than one GPU yet): the 8B case, then a step short enough (1B, 2,048
# tokens a GPU) that launching and FSDP's Python hooks may show, eager against graphed.
train fsdp-8b-bf16-graphs "$all" --flavor 8B --batch-size 1 \
    --strategy "{$compiled, \"activation_checkpointing\": \"selective_op\", \"cuda_graphs\": true}"
for graphs in false true; do
    train "fsdp-1b-seq2k-graphs-$graphs" "$two_or_all" --flavor 1B --batch-size 1 --seq-len 2048 \
        --strategy "{$compiled, \"cuda_graphs\": $graphs}"
done

# 2. 2-D: FSDP x TP2; the same with AsyncTP (TP's collectives overlapped with its matmuls).
for async_tp in false true; do
    train "fsdp-tp2-asynctp-$async_tp" "$two_or_all" --flavor 8B --batch-size 2 --strategy "{$compiled, \
\"tensor_parallel_size\": 2, \"async_tensor_parallel\": $async_tp, \"activation_checkpointing\": \"selective_op\"}"
done

# 3. PP=4 with FSDP over the rest; 8 microbatches of one sequence per data-parallel rank.
for schedule in 1F1B Interleaved1F1B ZBVZeroBubble; do
    per_rank=1; [ "$schedule" = 1F1B ] || per_rank=2
    train "pp4-$schedule" 8 --flavor 8B --batch-size 8 --strategy "{\"pipeline_parallel_size\": 4, \
\"pipeline_schedule\": \"$schedule\", \"pipeline_microbatches\": 8, \"pipeline_stages_per_rank\": $per_rank, \
\"activation_checkpointing\": \"full\"}"
done

# 4. CP: every data-parallel rank trains one sequence of 32k tokens per CP rank, over 8 GPUs.
for cp in 1 2 4 8; do
    train "cp$cp-8b-seq$((32 * cp))k" 8 --flavor 8B --batch-size 1 --seq-len $((32768 * cp)) \
        --strategy "{$compiled, \"context_parallel_size\": $cp, \"activation_checkpointing\": \"full\"}"
done

# 5. Hang drill over NCCL: rank 1 skips step 3's train-loss all-reduce; every rank must dump, and titan-fr
#    must name rank 1. The job is expected to fail (the others time out waiting).
if [ "$NGPU" -ge 2 ]; then
    echo "== nccl-hang-drill"
    drill="$out/drill"; mkdir -p "$drill"
    cat >"$drill/spec.json" <<EOF
{"devices": 2, "steps": 6, "batch_size": 4, "accelerator": "cuda",
 "trainer": {"clip": 1.0, "precision": "bf16-mixed", "strategy": {}},
 "drills": {"hang": {"rank": 1, "step": 3, "skip": "all_reduce"}},
 "callbacks": {"flight_recorder": {"timeout_s": 10, "dump_dir": "$drill/fr"}}}
EOF
    timeout 300 python tests/support/fork_launch.py 2 "$drill/spec.json" "$drill" >"$drill/job.log" 2>&1
    job_rc=$?
    python -m titan_strategy.flight_recorder.cli analyze "$drill/fr" >"$drill/analyze.log" 2>&1
    named=$(grep -c "Likely cause: ranks \[1\] never issued" "$drill/analyze.log")
    dumps=$(find "$drill/fr" -name 'rank_*.json' | wc -l)
    echo "{\"case\": \"nccl-hang-drill\", \"job_exit\": $job_rc, \"rank_dumps\": $dumps, \"skipper_named\": $((named > 0))}" \
        >>"$results"
    grep -m3 "Likely cause" "$drill/analyze.log"
else
    skip nccl-hang-drill "needs 2 GPUs"
fi

# 6. Blocking time per save under NCCL: the 8B model sharded over every GPU, two saves.
if [ "$SMOKE" = 1 ]; then
    ckpt_model=(--flavor debug --seq-len 256 --steps 12 --save-at 4 8)
else
    ckpt_model=(--flavor 8B --seq-len 8192 --steps 40 --save-at 8 32)
fi
for mode in sync async_pinned; do
    echo "== checkpoint-$mode"
    if timeout "$CASE_LIMIT_S" python benchmarks/checkpoint_save.py --mode "$mode" --dir "$out/ckpt" \
            --devices "$NGPU" --batch-size 1 "${ckpt_model[@]}" >"$out/checkpoint-$mode.log" 2>&1; then
        grep '^{' "$out/checkpoint-$mode.log" | tail -1 | python -c \
            'import json, sys; r = json.load(sys.stdin); print(json.dumps({"case": "checkpoint-" + r["mode"], **r}))' \
            >>"$results"
    else
        echo "{\"case\": \"checkpoint-$mode\", \"failed\": \"see $out/checkpoint-$mode.log\"}" >>"$results"
    fi
done

python - "$results" "$NGPU" <<'EOF'
import json, sys

rows, cases = [json.loads(line) for line in open(sys.argv[1])], {}
for row in rows:  # training cases print one line per rank: rank 0's speed, the largest peak of any rank
    case = cases.setdefault(row["case"], dict(row))
    for key in ("peak_allocated_gib", "peak_reserved_gib"):
        if key in row:
            case[key] = max(case[key], row[key])
    if row.get("rank") == 0:
        case.update({k: v for k, v in row.items() if not k.startswith("peak")})
print(f"\n| case ({sys.argv[2]} GPUs present) | tokens/s/GPU | MFU | peak alloc / reserved GiB (max over ranks) | other |")
print("|---|---|---|---|---|")
for name, case in cases.items():
    if "tokens_per_s_per_gpu" in case:
        print(f"| {name} | {case['tokens_per_s_per_gpu']:,} | {case['mfu_percent']}% | "
              f"{case['peak_allocated_gib']} / {case['peak_reserved_gib']} | |")
    else:
        other = {k: v for k, v in case.items() if k not in ("case", "rank")}
        print(f"| {name} | — | — | — | {json.dumps(other)} |")
EOF

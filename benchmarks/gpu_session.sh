#!/usr/bin/env bash
# The lent GPU machine's work, one phase per call of under ten minutes on nvidia-h200-x2 (device
# tool; wheels in .whl/ as the device README describes; LIMIT = seconds the phase may take).
# Every log and table is packed into $OUT/results.tgz; the main tables are also copied to $OUT.
#
#   run(kind="nvidia-h200-x2", carry=[".whl"], command="bash benchmarks/gpu_session.sh PHASE")
#
# kernel:  GPU 0: benchmarks/kda_kernel.py (ours vs fla vs xla, four shapes, per-kernel times).
#          GPU 1: the Pallas kernel's GPU tests, then train_throughput.py on configs/small.py
#                 (8 rows without remat, 32 rows with remat="full").
# scaling: benchmarks/scaling.py on configs/1b.py over 1 and 2 GPUs; meanwhile on GPU 1, while
#          the 1-GPU count runs on GPU 0, the long-context prefill series (carried KDA state vs
#          growing MLA cache).
# final:   after a kernel change: GPU 0 the kernel table again (with a launch-parameter sweep);
#          GPU 1 the GPU tests, the prefill series of the KDA models, and configs/small.py
#          trained with impl="pallas".
# nan:     benchmarks/kda_stress.py at the small model's shapes; small.py with impl="pallas" and
#          nan_policy=skip; the same with JAX_DEBUG_NANS.
# probe:   kda_stress.py with NaN-poisoned kernel outputs; two identical pallas training runs.
# verify:  GPU 0: the GPU tests, kda_stress.py, per-kernel times (default and plain-tf32 inverse).
#          GPU 1: configs/small.py trained with impl="pallas" then "xla", same data and init
#                 (loss curves to compare; nan_policy=stop).
# kernel2: GPU 0: ours vs fla on the four shapes (no xla), per-kernel times, launch sweep.
#          GPU 1: the GPU tests (default launch parameters); kda_stress.py as built and with
#                 the tf32x3 inverse (--tune inverse_x3=1).
# final3:  GPU 0: ours vs fla on the four shapes with per-kernel times (no xla).
#          GPU 1: the GPU tests, kda_stress.py, configs/small.py with impl="auto" (STEPS steps).
# final2:  final3 after a launch-parameter sweep at 8x4096 (VARIANTS), the fastest adopted.
set -u
PHASE=${1:?one of kernel, scaling, final, nan, probe, verify, kernel2, final2, final3}
OUT=${OUT:-/tmp/gpu_out}
W=/tmp/work
mkdir -p "$OUT" "$W"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$W/gpus.txt"
date -u | tee -a "$W/gpus.txt"
LIMIT=${LIMIT:-540}

pack() {
    tar czf "$OUT/results.tgz" -C "$W" . 2>/dev/null
    ls -la "$W"
}
trap pack EXIT

if [ "$PHASE" = kernel ]; then
    (CUDA_VISIBLE_DEVICES=0 timeout $((LIMIT - 10)) python3 benchmarks/kda_kernel.py --breakdown --sweep 8x4096 \
        --variants "inverse_x3=0;warps_intra=8;bk=64" --out "$W/kda_table.md" \
        > "$W/kda_kernel.log" 2>&1; cp "$W/kda_table.md" "$OUT/" ) &
    (
        export CUDA_VISIBLE_DEVICES=1
        timeout 200 python3 -m pytest tests/test_kda_pallas.py -q -k gpu -p no:cacheprovider \
            > "$W/gpu_tests.log" 2>&1
        timeout 150 python3 benchmarks/train_throughput.py --config=configs/small.py \
            --workdir="$W/small_b8" --config.train.steps=80 --config.train.log_every=20 \
            --out="$W/train_small_b8.md" > "$W/train_small_b8.log" 2>&1
        timeout $((LIMIT - 360)) python3 benchmarks/train_throughput.py --config=configs/small.py \
            --workdir="$W/small_b32" --config.data.global_batch_size=32 \
            --config.model.remat=full --config.train.steps=40 --config.train.log_every=10 \
            --out="$W/train_small_b32_remat.md" > "$W/train_small_b32.log" 2>&1
        rm -rf "$W"/small_b*/checkpoints
    ) &
    wait
    tail -n 3 "$W/gpu_tests.log"; cat "$W"/train_small_*.md "$W/kda_table.md" 2>/dev/null
    grep -E "first call|sweep|failed" "$W/kda_kernel.log"
elif [ "$PHASE" = scaling ]; then
    (CUDA_VISIBLE_DEVICES=1 timeout 200 python3 benchmarks/long_context_memory.py \
        --out_dir="$W/prefill" --modes=prefill --seq_lens=8192,32768,131072,524288 \
        --repeats=1 --max_seconds=15 > "$W/prefill.log" 2>&1) &
    PREFILL=$!
    timeout 250 python3 benchmarks/scaling.py --config=configs/1b.py --counts=1 \
        --per_device_batch=4 --steps=20 --log_every=5 --out_dir="$W/scaling" > "$W/scaling1.log" 2>&1
    wait $PREFILL
    timeout $((LIMIT - 260)) python3 benchmarks/scaling.py --config=configs/1b.py --counts=1,2 \
        --per_device_batch=4 --steps=20 --log_every=5 --out_dir="$W/scaling" \
        --reuse > "$W/scaling2.log" 2>&1
    rm -rf "$W"/scaling/run_*/checkpoints
    cat "$W/scaling/scaling.md" "$W"/prefill/*.md 2>/dev/null; tail -n 5 "$W/prefill.log"
    cp "$W/scaling/scaling.md" "$W/scaling/scaling.png" "$OUT/" 2>/dev/null
elif [ "$PHASE" = final ]; then
    (CUDA_VISIBLE_DEVICES=0 timeout $((LIMIT - 10)) python3 benchmarks/kda_kernel.py --breakdown \
        --sweep 8x4096 --variants "inverse_x3=0;warps_chan=8;warps_grad=4;bk=64" \
        --out "$W/kda_table.md" > "$W/kda_kernel.log" 2>&1; cp "$W/kda_table.md" "$OUT/" ) &
    (
        export CUDA_VISIBLE_DEVICES=1
        timeout 150 python3 -m pytest tests/test_kda_pallas.py -q -k gpu -p no:cacheprovider \
            > "$W/gpu_tests.log" 2>&1
        timeout 170 python3 benchmarks/long_context_memory.py --out_dir="$W/prefill" \
            --modes=prefill --variants=all-KDA,3:1 --seq_lens=8192,32768,131072,524288,1048576 \
            --repeats=1 --max_seconds=15 > "$W/prefill.log" 2>&1
        timeout $((LIMIT - 340)) python3 benchmarks/train_throughput.py --config=configs/small.py \
            --workdir="$W/small_pallas" --config.model.kda.impl=pallas --config.train.steps=40 \
            --config.train.log_every=10 --out="$W/train_small_pallas.md" > "$W/train_pallas.log" 2>&1
    ) &
    wait
    tail -n 3 "$W/gpu_tests.log"; cat "$W"/train_small_*.md "$W/kda_table.md" "$W"/prefill/*.md 2>/dev/null
    grep -E "first call|sweep|failed" "$W/kda_kernel.log"
elif [ "$PHASE" = nan ]; then  # configs/small.py went NaN at step 10 with impl="pallas"
    (
        export CUDA_VISIBLE_DEVICES=0
        timeout 150 python3 benchmarks/kda_stress.py > "$W/stress.log" 2>&1
        timeout $((LIMIT - 160)) python3 benchmarks/train_throughput.py --config=configs/small.py \
            --workdir="$W/small_skip" --config.model.kda.impl=pallas --config.train.steps=40 \
            --config.train.log_every=5 --config.train.nan_policy=skip \
            --out="$W/train_small_pallas_skip.md" > "$W/train_skip.log" 2>&1
    ) &
    (CUDA_VISIBLE_DEVICES=1 JAX_DEBUG_NANS=True timeout $((LIMIT - 10)) python3 \
        benchmarks/train_throughput.py --config=configs/small.py --workdir="$W/small_dbg" \
        --config.model.kda.impl=pallas --config.train.steps=20 --config.train.log_every=5 \
        > "$W/train_debug_nans.log" 2>&1) &
    wait
    cat "$W/stress.log"; grep -E "step|skipped|Error|nan" "$W/train_skip.log" | tail -n 12
    grep -vE "^\s*$" "$W/train_debug_nans.log" | tail -n 40
elif [ "$PHASE" = probe ]; then  # unwritten outputs, and determinism of the model's steps
    (CUDA_VISIBLE_DEVICES=0 timeout 150 python3 benchmarks/kda_stress.py --poison --cases 4 \
        > "$W/stress_poison.log" 2>&1) &
    for run in a b; do
        (CUDA_VISIBLE_DEVICES=1 timeout 170 python3 benchmarks/train_throughput.py \
            --config=configs/small.py --workdir="$W/probe_$run" --config.model.kda.impl=pallas \
            --config.train.steps=6 --config.train.log_every=1 --config.train.nan_policy=skip \
            > "$W/probe_$run.log" 2>&1) &
    done
    wait
    cat "$W/stress_poison.log"
    for run in a b; do grep -oE "step [0-9]+: loss=[0-9.a-z]+ grad_norm=[0-9.a-z]+" "$W/probe_$run.log"; done
elif [ "$PHASE" = verify ]; then
    STEPS=${STEPS:-150}
    (
        export CUDA_VISIBLE_DEVICES=0
        timeout 200 python3 -m pytest tests/test_kda_pallas.py -q -k gpu -p no:cacheprovider \
            > "$W/gpu_tests.log" 2>&1
        timeout 150 python3 benchmarks/kda_stress.py > "$W/stress.log" 2>&1
        timeout 90 python3 benchmarks/kda_kernel.py --shapes 8x4096 --breakdown-only \
            > "$W/breakdown.log" 2>&1
        timeout $((LIMIT - 450)) python3 benchmarks/kda_kernel.py --shapes 8x4096 --breakdown-only \
            --tune inverse_x3=0 > "$W/breakdown_tf32_inverse.log" 2>&1
    ) &
    (
        export CUDA_VISIBLE_DEVICES=1
        for impl in pallas xla; do
            T_LIM=$((LIMIT - 210)); [ $impl = pallas ] && T_LIM=200
            timeout $T_LIM python3 benchmarks/train_throughput.py \
                --config=configs/small.py --workdir="$W/small_$impl" --config.model.kda.impl=$impl \
                --config.train.steps=$STEPS --config.train.log_every=10 \
                --config.checkpoint.enabled=False --out="$W/train_small_$impl.md" \
                > "$W/train_$impl.log" 2>&1
        done
    ) &
    wait
    tail -n 3 "$W/gpu_tests.log"; cat "$W/stress.log" "$W"/breakdown*.log "$W"/train_small_*.md
    for impl in pallas xla; do
        echo "== $impl"; python3 -c "import json,sys; [print(r.get('step'), round(r.get('loss', -1), 4), \
            round(r.get('grad_norm', -1), 4)) for r in map(json.loads, open(sys.argv[1]))]" \
            "$W/small_$impl/metrics.jsonl" 2>&1 | tail -n 16
        grep -E "Stopping|non-finite|Error" "$W/train_$impl.log" | head -n 3
    done
elif [ "$PHASE" = kernel2 ]; then
    (CUDA_VISIBLE_DEVICES=0 timeout $((LIMIT - 10)) python3 benchmarks/kda_kernel.py --no-xla \
        --shapes "${SHAPES:-8x4096,2x16384,1x65536,1x262144}" \
        --breakdown --sweep 8x4096 --variants "${VARIANTS:-inverse_x3=0}" \
        --out "$W/kda_table.md" > "$W/kda_kernel.log" 2>&1; cp "$W/kda_table.md" "$OUT/" ) &
    (
        export CUDA_VISIBLE_DEVICES=1
        timeout 200 python3 -m pytest tests/test_kda_pallas.py -q -k gpu -p no:cacheprovider \
            > "$W/gpu_tests.log" 2>&1
        for tune in "" inverse_x3=1; do
            timeout 100 python3 benchmarks/kda_stress.py --tune="$tune" \
                > "$W/stress_${tune:-default}.log" 2>&1
        done
    ) &
    wait
    grep -E "passed|failed|Error" "$W/gpu_tests.log" | tail -n 8
    tail -n 14 "$W"/stress_*.log; cat "$W/kda_table.md"
    grep -E "ms|failed" "$W/kda_kernel.log"
elif [ "$PHASE" = final2 ] || [ "$PHASE" = final3 ]; then
    SWEEP_ARGS=()  # final2: sweep VARIANTS at 8x4096 first and adopt the fastest
    [ "$PHASE" = final2 ] && SWEEP_ARGS=(--adopt --sweep 8x4096 --variants "${VARIANTS:-bk=64;bv_intra=128}")
    (CUDA_VISIBLE_DEVICES=0 timeout $((LIMIT - 10)) python3 benchmarks/kda_kernel.py --no-xla \
        --breakdown "${SWEEP_ARGS[@]}" --out "$W/kda_table.md" > "$W/kda_kernel.log" 2>&1
        cp "$W/kda_table.md" "$OUT/" ) &
    (
        export CUDA_VISIBLE_DEVICES=1
        timeout 120 python3 -m pytest tests/test_kda_pallas.py -q -k gpu -p no:cacheprovider \
            > "$W/gpu_tests.log" 2>&1
        timeout 90 python3 benchmarks/kda_stress.py > "$W/stress.log" 2>&1
        timeout $((LIMIT - 220)) python3 benchmarks/train_throughput.py --config=configs/small.py \
            --workdir="$W/small_auto" --config.train.steps=${STEPS:-100} --config.train.log_every=10 \
            --config.checkpoint.enabled=False --out="$W/train_small_auto.md" > "$W/train_auto.log" 2>&1
    ) &
    wait
    grep -E "passed|failed|Error" "$W/gpu_tests.log" | tail -n 8; tail -n 13 "$W/stress.log"
    cat "$W/kda_table.md" "$W/train_small_auto.md"; grep -E " ms|failed|adopted" "$W/kda_kernel.log"
    python3 -c "import json,sys; [print(r.get('step'), round(r.get('loss', -1), 4), \
        round(r.get('grad_norm', -1), 4)) for r in map(json.loads, open(sys.argv[1]))]" \
        "$W/small_auto/metrics.jsonl" 2>&1 | tail -n 16
fi

#!/usr/bin/env bash
# Long-context, decoding and MoE measurements on the lent H200 (device tool, one GPU), one phase
# per call:
#
#   run(carry=[".whl"], command="bash benchmarks/gpu_longctx.sh PHASE")   # .whl: ml-collections,
#                                                                          # tensorboardX wheels
# check:   the cache-attention tests on the GPU (cuDNN blocks with their log-sum-exp), then
#          eval.py at context 1,048,576 on a 1B-shaped 3:1 model (fresh weights, pieces of 64K),
#          then long_context_memory.py for 3:1 at the 1B shapes (forward and prefill, 8K..1M).
# check2: the same tests, cache_attention_bench.py (cuDNN block forms), eval.py at 1M (half of
#          the stdlib files held out, so a 1M-token window exists), 3:1 prefill at 128K and 1M.
# series:  long_context_memory.py for all-MLA (to 512K) and all-KDA (to 1M) at the 1B shapes.
# decode:  benchmarks/decode_bench.py (time per output token at 8K, 128K and 1M, batch 1 and
#          the largest that fits), then the series above.
# moe:     benchmarks/moe_bench.py (the MoE layer: ragged_dot vs one-hot einsum; moe_1b vs 1b).
# moe2:    the grouped-matmul tests on the GPU (Hopper kernels against float64), then
#          moe_bench.py: the layer with the Mosaic GPU grouped matmul against the one-hot and
#          dense forms and capacity, and moe_1b ("auto": the Hopper kernels) against 1b.
# gmm:     benchmarks/grouped_matmul_bench.py (the Hopper grouped matmul alone, 32K and 256K
#          rows), moe_1b's training step alone, then eval.py at 1M once.
# eval1m:  eval.py at context 1,048,576 on a 1B-shaped 3:1 model (as check2), twice: the
#          second run finds its programs in the persistent compilation cache.
# moe3:    the grouped-matmul tests on the GPU, the grouped matmul at 32K rows, then moe_1b
#          ("auto": the Hopper kernels) against 1b in one moe_bench.py run.
# mla1m:   all-MLA prefill at 1,048,576 tokens (the Kimi Linear report's 1M prefill ratio).
# Tables go to $OUT; logs to $OUT/logs.tgz.
set -u
PHASE=${1:?one of check, check2, series, decode, moe, moe2, gmm, eval1m, moe3, mla1m}
OUT=${OUT:-/tmp/gpu_out}
W=/tmp/work
mkdir -p "$OUT" "$W"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$W/gpu.txt"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$W/gpu.txt"

pack() { tar czf "$OUT/logs.tgz" -C "$W" . 2>/dev/null; ls -la "$OUT"; }
trap pack EXIT
quiet() { grep -v "^[IW][0-9]" | grep -v "^\s*$"; }
SHAPES_1B="--d_model=2048 --num_layers=20 --heads=16 --head_dim=128 --kv_lora_rank=512"

lcm() {  # name, timeout, long_context_memory flags...
    local name=$1 limit=$2
    shift 2
    timeout "$limit" python3 benchmarks/long_context_memory.py $SHAPES_1B --out_dir="$W/lcm_$name" \
        "$@" > "$W/lcm_$name.log" 2>&1
    cp "$W/lcm_$name/long_context_memory.md" "$OUT/lcm_$name.md" 2>/dev/null
    quiet < "$W/lcm_$name.log" | tail -n 30
}

if [ "$PHASE" = check ]; then
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_layers.py -k "cache" 2>&1 \
        | tail -n 15 | tee "$W/tests.log"
    START=$(date +%s)
    timeout 200 python3 eval.py --config=configs/1b.py --checkpoint=init --context_lengths=1M \
        --piece_len=65536 --max_windows=1 --short_docs=concat --workdir="$W/eval_1m" \
        > "$W/eval_1m.log" 2>&1
    echo "eval.py at 1M: rc=$? wall $(( $(date +%s) - START )) s (compilation included)" \
        | tee -a "$W/eval_1m.log"
    quiet < "$W/eval_1m.log" | tail -n 25
    cp "$W/eval_1m.log" "$OUT/eval_1m.log"
    lcm 3to1 260 --variants=3:1 --seq_lens=8192,131072,524288,1048576 --piece_len=65536 \
        --repeats=1 --max_seconds=120
fi

if [ "$PHASE" = check2 ]; then
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_layers.py -k "cache" 2>&1 \
        | grep -E "passed|failed|Error|error|FAILED|assert|Mismatch|Max" | head -n 40 \
        | tee "$W/tests.log"
    timeout 90 python3 benchmarks/cache_attention_bench.py 2>&1 | quiet | tee "$OUT/cache_attention.md"
    START=$(date +%s)
    timeout 150 python3 eval.py --config=configs/1b.py --checkpoint=init --context_lengths=1M \
        --piece_len=65536 --max_windows=1 --short_docs=concat --config.data.eval_fraction=0.5 \
        --workdir="$W/eval_1m" > "$W/eval_1m.log" 2>&1
    echo "eval.py at 1M: rc=$? wall $(( $(date +%s) - START )) s (compilation included)" \
        | tee -a "$W/eval_1m.log"
    quiet < "$W/eval_1m.log" | tail -n 25
    cp "$W/eval_1m.log" "$OUT/eval_1m.log"
    lcm 3to1p 150 --variants=3:1 --modes=prefill --seq_lens=131072,1048576 --piece_len=65536 \
        --repeats=1 --max_seconds=100
fi

series() {
    lcm mla 170 --variants=all-MLA --seq_lens=8192,131072,524288 --piece_len=65536 \
        --repeats=1 --max_seconds=80
    lcm kda 110 --variants=all-KDA --seq_lens=8192,131072,524288,1048576 --piece_len=65536 \
        --repeats=1 --max_seconds=40
}

decode() {
    JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache timeout 260 python3 benchmarks/decode_bench.py \
        --out_dir="$W/decode" $SHAPES_1B --contexts=8192,131072,1048576 --variants=all-MLA,3:1 \
        --search=jump --max_batch=64 --warmup=2 --steps=3 --max_seconds=60 \
        > "$W/decode.log" 2>&1
    cp "$W/decode/"*.md "$OUT/" 2>/dev/null
    quiet < "$W/decode.log" | tail -n 40
}

if [ "$PHASE" = moe ]; then
    timeout 420 python3 benchmarks/moe_bench.py --out_dir="$W/moe" --budget_s=380 \
        --layer_timeout_s=110 --train_timeout_s=140 --steps=6 > "$W/moe.log" 2>&1
    cp "$W/moe/moe_bench.md" "$OUT/" 2>/dev/null
    quiet < "$W/moe.log" | tail -n 50
fi

if [ "$PHASE" = moe2 ]; then
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_grouped_matmul.py \
        tests/test_moe.py -k "grouped or mosaic or expert_matmul or numpy" 2>&1 \
        | grep -E "passed|failed|Error|error|FAILED|assert|err" | head -n 40 | tee "$W/tests.log"
    timeout 400 python3 benchmarks/moe_bench.py --out_dir="$W/moe" --budget_s=380 \
        --variants=mosaic_gpu,onehot,dense,capacity --train_runs=dense,moe \
        --layer_timeout_s=90 --train_timeout_s=150 --steps=6 > "$W/moe.log" 2>&1
    cp "$W/moe/moe_bench.md" "$OUT/" 2>/dev/null
    quiet < "$W/moe.log" | tail -n 50
fi

if [ "$PHASE" = gmm ]; then
    timeout 150 python3 benchmarks/grouped_matmul_bench.py --impls=mosaic_gpu,einsum 2>&1 \
        | quiet | tee "$OUT/grouped_matmul.md"
    timeout 200 python3 benchmarks/moe_bench.py --out_dir="$W/moe" --budget_s=190 --mode=train \
        --train_runs=moe --train_timeout_s=185 --steps=4 > "$W/moe.log" 2>&1
    cp "$W/moe/moe_bench.md" "$OUT/moe_train.md" 2>/dev/null
    quiet < "$W/moe.log" | grep -v "^RESULT" | tail -n 25
fi

if [ "$PHASE" = eval1m ] || [ "$PHASE" = gmm ]; then
    RUNS="1 2"; [ "$PHASE" = gmm ] && RUNS=1
    for run in $RUNS; do
        START=$(date +%s)
        timeout 200 python3 eval.py --compilation_cache=/tmp/jax_cache \
            --config=configs/1b.py --checkpoint=init --context_lengths=1M --piece_len=65536 \
            --max_windows=1 --short_docs=concat --config.data.eval_fraction=0.5 \
            --workdir="$W/eval_1m_$run" > "$W/eval_1m_$run.log" 2>&1
        echo "eval.py at 1M (run $run): rc=$? wall $(( $(date +%s) - START )) s" \
            | tee -a "$W/eval_1m_$run.log"
        quiet < "$W/eval_1m_$run.log" | tail -n 20
        cp "$W/eval_1m_$run.log" "$OUT/"
    done
fi

if [ "$PHASE" = moe3 ]; then
    timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_grouped_matmul.py \
        tests/test_moe.py -k "grouped or mosaic or expert_matmul or float64" 2>&1 \
        | grep -E "passed|failed|Error|error|FAILED|assert|err" | head -n 40 | tee "$W/tests.log"
    timeout 60 python3 benchmarks/grouped_matmul_bench.py --rows=32768 --shapes=2048x1024 \
        --impls=mosaic_gpu,einsum 2>&1 | quiet | tee "$OUT/grouped_matmul_32k.md"
    timeout ${MOE_LIMIT:-330} python3 benchmarks/moe_bench.py --out_dir="$W/moe" --mode=train \
        --budget_s=$(( ${MOE_LIMIT:-330} - 10 )) --train_runs=dense,moe \
        --train_timeout_s=$(( ${MOE_LIMIT:-330} - 20 )) --steps=3 > "$W/moe.log" 2>&1
    cp "$W/moe/moe_bench.md" "$OUT/moe_train.md" 2>/dev/null
    quiet < "$W/moe.log" | grep -v "^RESULT" | tail -n 25
fi

if [ "$PHASE" = mla1m ]; then
    lcm mla1m 270 --variants=all-MLA --modes=prefill --seq_lens=1048576 --piece_len=65536 \
        --repeats=1 --max_seconds=260
fi

if [ "$PHASE" = series ]; then series; fi
if [ "$PHASE" = decode ]; then decode; series; fi

#!/usr/bin/env bash
# Training-throughput work on the lent H200 (device tool, one GPU), one phase per call:
#
#   run(carry=[".whl"], command="bash benchmarks/gpu_mfu.sh PHASE")      # .whl: ml-collections,
#                                                                          # tensorboardX wheels
# profile:  the dense same-card anchor (../shared/tools/dense_anchor.py copied to ANCHOR, if
#           present), then benchmarks/step_profile.py on configs/1b.py at 8 x 4096 (its default
#           full remat) and at 4 x 4096 with remat="dots".
# fixes:    attention_bench.py at the 1B MLA shapes (xla, pallas, cudnn), then step_profile.py
#           on configs/1b.py at 8 x 4096 with full and with "dots" remat.
# remat:    attention_bench.py with one-document rows too; step_profile.py on configs/1b.py
#           with remat="dots_kernels" at 8 and 4 rows.
# mfu:      step_profile.py and train_throughput.py for the table in BENCHMARKS.md (1b 3:1,
#           all-MLA, all-KDA, small), with the settings under test (EXTRA overrides).
# step2:    the packed-document cuDNN attention checked (tests) and timed against the mask,
#           short_conv_bench.py, then step_profile.py on configs/1b.py at 4 rows, layers
#           unrolled (SourceList Attention Residuals) and scanned.
# step3:    the GPU cases of the packed-attention, short-conv and gate-in-kernel tests; the
#           attention table; step_profile.py on configs/1b.py at 4 rows; configs/1b.py as
#           written; configs/small.py 50 steps, this code and the code in .old/ (loss curves).
# loss:     configs/small.py, STEPS steps (default 50), this code and the code in .old/; with
#           NOISE=1 also this code in two micro-batches of 16 rows (the same sums in another
#           order: the run-to-run noise the two curves are judged against).
# paths:    configs/small.py with 6 KDA heads of 128, STEPS steps, on the card's default KDA
#           path and on the portable Triton kernels (model.kda.kernel_tuning=hopper=0): #19's
#           loss curves.
# paths_1b: configs/1b.py as written on each of the two, its micro-batch of 4 rows given (the
#           automatic estimate compiles the gradient once more); ~300 s cold, then ~130 s.
# unrolled: step_profile.py on configs/1b.py at 4 rows with the layers unrolled
#           (scan_layers=False: SourceList Attention Residuals), and its compile time.
# gaps:     is the time the 1B step spends outside kernels (~18 ms per 4-row micro-batch,
#           BENCHMARKS.md twelfth pass) launches? configs/1b.py as written with XLA's command
#           buffers as they come, then with the micro-batch loop and the conditionals inside
#           them (WHILE, CONDITIONAL); then the accumulating step's profile (8 rows in
#           micro-batches of 4) with the device's idle time by part. ~600 s cold.
# prof NAME LIMIT FLAGS...:  one step_profile.py run (profile_NAME.md), e.g.
#           bash benchmarks/gpu_mfu.sh prof 1b_b4 240 --config=configs/1b.py \
#               --config.data.global_batch_size=4
# tp NAME LIMIT STEPS EVERY FLAGS...:  one train_throughput.py run (throughput_NAME.md). On a
#           fresh machine the unrolled configs/1b.py with --config.train.microbatch_size=4
#           reached its fourth step in ~300 s (the initialiser compiled for ~2 min of it: 21.6 s
#           since, by init_compile.py --options; the step ~2.5 min); a second tp ~130 s.
# py NAME LIMIT SCRIPT ARGS...:  any benchmark script, its table to NAME.md, e.g.
#           bash benchmarks/gpu_mfu.sh py attn_res 150 benchmarks/attn_res_bench.py
# TREE=DIR runs prof and tp from another copy of the code (carried, like .old/), to compare a
#           branch with this tree in one call:  git archive BRANCH | tar -x -C .alt   (here),
#           run(carry=[".whl", ".alt"], command="TREE=.alt bash benchmarks/gpu_mfu.sh tp ...").
# Several phases in one call: separate them with ";" in the device command.
# Tables go to $OUT; logs and traces to $OUT/logs.tgz.
set -u
PHASE=${1:?one of profile, fixes, remat, mfu, step2, step3, loss, paths, paths_1b, unrolled, gaps, prof, tp, py}
shift
OUT=${OUT:-/tmp/gpu_out}
W=/tmp/work
mkdir -p "$OUT" "$W"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
# Every run of a call shares compiled programs: the unrolled 1B initialiser alone compiles for
# about two minutes on the card, and is the same program for every flag tried after it.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jcache}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$W/gpu.txt"
ANCHOR=${ANCHOR:-benchmarks/results/dense_anchor.py}
EXTRA=${EXTRA:-}

pack() { tar czf "$OUT/logs.tgz" -C "$W" --exclude='*.xplane.pb' . 2>/dev/null; ls -la "$OUT"; }
trap pack EXIT

profile() {  # name, timeout, config flags...
    local name=$1 limit=$2
    shift 2
    # Without command buffers every kernel is its own event in the trace (with them, XLA
    # replays whole graphs and the trace shows one event per graph); the step time is the same.
    (cd "${TREE:-.}" && XLA_FLAGS="--xla_gpu_enable_command_buffer=" timeout "$limit" \
        python3 benchmarks/step_profile.py "$@" --steps=6 --trace_steps=2 \
        --trace_dir="$W/trace_$name" --out="$OUT/profile_$name.md" --ops_out="$W/ops_$name.csv" \
        > "$W/profile_$name.log" 2>&1)
    grep -v "^[IW][0-9]" "$W/profile_$name.log" | tail -n 40
}

if [ "$PHASE" = fixes ]; then
    timeout 150 python3 benchmarks/attention_bench.py --impls=xla,pallas,cudnn 2>&1 \
        | grep -v "^[IW][0-9]" | tee "$OUT/attention.md"
    profile 1b_b8_full 240 --config=configs/1b.py --config.data.global_batch_size=8 $EXTRA
    profile 1b_b8_dots 200 --config=configs/1b.py --config.data.global_batch_size=8 \
        --config.model.remat=dots $EXTRA
fi

if [ "$PHASE" = remat ]; then
    timeout 100 python3 benchmarks/attention_bench.py --impls=xla,pallas,cudnn,cudnn:rows \
        2>&1 | grep -v "^[IW][0-9]" | tee "$OUT/attention.md"
    profile 1b_b8_dk 220 --config=configs/1b.py --config.data.global_batch_size=8 \
        --config.model.remat=dots_kernels $EXTRA
    profile 1b_b4_dk 200 --config=configs/1b.py --config.data.global_batch_size=4 \
        --config.model.remat=dots_kernels $EXTRA
fi

tp() {  # name, timeout, steps, log_every, config flags...: train_throughput.py (the real loop)
    local name=$1 limit=$2 steps=$3 every=$4
    shift 4
    (cd "${TREE:-.}" && timeout "$limit" python3 benchmarks/train_throughput.py "$@" \
        --workdir="$W/run_$name" --config.train.steps="$steps" --config.train.log_every="$every" \
        --out="$OUT/throughput_$name.md" > "$W/throughput_$name.log" 2>&1)
    grep -E "^\| [a-z0-9_]+\.py|micro-batch" "$W/throughput_$name.log" | tail -n 2
}

loss_curves() {  # steps, timeout per run: configs/small.py, steps logged one by one, this code
    # and the code before the work (carried in .old/), same seed and data: loss_{new,old}.jsonl.
    local steps=$1 limit=$2
    rm -rf "$W/run_small" "$W/run_small_old"  # a warm machine keeps the last call's runs
    tp small "$limit" "$steps" 1 --config=configs/small.py
    cp "$W/run_small/metrics.jsonl" "$OUT/loss_new.jsonl"
    if [ -n "${NOISE:-}" ]; then  # the same maths summed in another order: two micro-batches
        rm -rf "$W/run_small_mb16"
        tp small_mb16 "$limit" "$steps" 1 --config=configs/small.py \
            --config.train.microbatch_size=16
        cp "$W/run_small_mb16/metrics.jsonl" "$OUT/loss_noise.jsonl"
    fi
    (cd .old && timeout "$limit" python3 benchmarks/train_throughput.py \
        --config=configs/small.py --workdir="$W/run_small_old" --config.train.steps="$steps" \
        --config.train.log_every=1 --out="$W/throughput_small_old.md" \
        > "$W/throughput_small_old.log" 2>&1)
    cp "$W/run_small_old/metrics.jsonl" "$OUT/loss_old.jsonl"
    local runs=("this=$OUT/loss_new.jsonl" "before=$OUT/loss_old.jsonl")
    [ -f "$OUT/loss_noise.jsonl" ] && runs+=("noise=$OUT/loss_noise.jsonl")
    python3 benchmarks/loss_curves.py "${runs[@]}" --out="$OUT/loss_curves.png" \
        | tee "$OUT/loss_curves.md"
}

if [ "$PHASE" = mfu ]; then
    # configs/1b.py as written (64 x 4096 in micro-batches), then the same-run table at 8 x 4096.
    tp 1b_64 150 6 2 --config=configs/1b.py
    B8="--config.data.global_batch_size=8 --config.train.microbatch_size=4"
    tp 1b_8 70 12 4 --config=configs/1b.py $B8
    tp mla_8 70 12 4 --config=configs/1b.py $B8 --config.model.pattern=MMMMMMMMMMMMMMMMMMMM
    tp kda_8 70 12 4 --config=configs/1b.py $B8 --config.model.pattern=KKKKKKKKKKKKKKKKKKKK
    loss_curves 50 100
fi

if [ "$PHASE" = step2 ]; then
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_layers.py \
        -k "packed or attn_res" 2>&1 | tail -n 15 | tee "$OUT/tests.txt"
    timeout 60 python3 benchmarks/attention_bench.py --batch=4 --impls=xla,cudnn,cudnn:mask \
        2>&1 | grep -v "^[IW][0-9]" | tee "$OUT/attention.md"
    timeout 45 python3 benchmarks/short_conv_bench.py 2>&1 | grep -v "^[IW][0-9]" \
        | tee "$OUT/short_conv.md"
    profile 1b_b4_unrolled 200 --config=configs/1b.py --config.data.global_batch_size=4 \
        --config.model.scan_layers=False $EXTRA
    profile 1b_b4_scanned 120 --config=configs/1b.py --config.data.global_batch_size=4 $EXTRA
fi

if [ "$PHASE" = step3 ]; then
    if [ -z "${SKIP_TESTS:-}" ]; then
        timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_layers.py \
            tests/test_kda_gate_in_kernel.py -k "packed or conv or gate" 2>&1 | tail -n 12 \
            | tee "$OUT/tests.txt"
    fi
    timeout 90 python3 benchmarks/attention_bench.py --batch=4 --impls=cudnn:mask,cudnn \
        2>&1 | grep "^|\|documents" | tee "$OUT/attention.md"
    profile 1b_b4 110 --config=configs/1b.py --config.data.global_batch_size=4 $EXTRA
    tp 1b_64 150 6 2 --config=configs/1b.py
    loss_curves 50 70
fi

if [ "$PHASE" = loss ]; then
    loss_curves "${STEPS:-50}" "${LOSS_LIMIT:-200}"  # configs/small.py compiles for ~85 s on the card
fi

if [ "$PHASE" = paths ]; then
    # Issue #19's loss target: configs/small.py, STEPS steps (default 50), on the card's default
    # KDA path (on Hopper: the Mosaic GPU intra_bwd_scores) and on the portable Triton kernels
    # (model.kda.kernel_tuning=hopper=0), same seed and data. The Mosaic GPU kernels take
    # K = V = 128 only, so both runs have 6 KDA heads of 128 (the same width as small's 12 of
    # 64). The 1B step on each: phase paths_1b.
    rm -rf "$W/run_small_default" "$W/run_small_triton"
    small_flags="--config=configs/small.py --config.model.num_heads=6 --config.model.kda.head_dim=128"
    limit=${LOSS_LIMIT:-200} steps=${STEPS:-50}  # the first run ~150 s cold, the second ~100 s
    tp small_default "$limit" "$steps" 1 $small_flags
    tp small_triton "$limit" "$steps" 1 $small_flags --config.model.kda.kernel_tuning=hopper=0
    python3 benchmarks/loss_curves.py "default=$W/run_small_default/metrics.jsonl" \
        "triton=$W/run_small_triton/metrics.jsonl" --out="$OUT/paths_loss.png" \
        | tee "$OUT/paths_loss.md"
fi

if [ "$PHASE" = paths_1b ]; then  # configs/1b.py as written: the default path, then Triton only
    mb4="--config.train.microbatch_size=4"
    tp 1b_default "${LIMIT_1B:-350}" 4 2 --config=configs/1b.py $mb4
    tp 1b_triton 225 4 2 --config=configs/1b.py $mb4 --config.model.kda.kernel_tuning=hopper=0
fi

if [ "$PHASE" = unrolled ]; then
    profile 1b_b4_unrolled 420 --config=configs/1b.py --config.data.global_batch_size=4 \
        --config.model.scan_layers=False $EXTRA
fi

if [ "$PHASE" = gaps ]; then
    mb4="--config=configs/1b.py --config.train.microbatch_size=4"
    tp 1b_cmdbuf_default 280 4 2 $mb4
    (export XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL"
     tp 1b_cmdbuf_loops 200 4 2 $mb4)
    profile 1b_accum "${PROF_LIMIT:-250}" --config=configs/1b.py \
        --config.data.global_batch_size=8 --config.train.microbatch_size=4
fi

if [ "$PHASE" = prof ]; then
    profile "$@"
fi

if [ "$PHASE" = tp ]; then
    tp "$@"
fi

if [ "$PHASE" = py ]; then
    name=$1 limit=$2
    shift 2
    timeout "$limit" python3 "$@" > "$W/$name.log" 2>&1
    grep -v "^[IW][0-9]" "$W/$name.log" | tee "$OUT/$name.md" | tail -n 30
fi

if [ "$PHASE" = profile ]; then
    if [ -f "$ANCHOR" ]; then
        timeout 120 python3 "$ANCHOR" --remat dots --batch 8 2>&1 | tail -n 2 | tee "$OUT/anchor.txt"
    fi
    profile 1b_b8_full 260 --config=configs/1b.py --config.data.global_batch_size=8 $EXTRA
    profile 1b_b4_dots 200 --config=configs/1b.py --config.data.global_batch_size=4 \
        --config.model.remat=dots $EXTRA
fi

#!/usr/bin/env bash
# docs/BENCHMARKS.md "On a GPU" as one script: the training-step, MFU and CUDA-graph benchmarks and
# the CUDA tests (and on request a host-side profile of the step, sampling and growth), on the
# ddpm-cifar10 preset at 32x32x3 in bf16. Each part has its own time limit, so one that hangs or fails still leaves the
# others' results. Results go to OUT (default
# benchmarks/results/gpu); the full log to OUT/on_gpu.log.
#
#     bash benchmarks/on_gpu.sh [OUT]
#     PARTS="train-step growth" bash benchmarks/on_gpu.sh [OUT]     # only these parts
#     REHEARSE=1 PYTHON=.venv/bin/python bash benchmarks/on_gpu.sh /tmp/reh   # every part on this CPU, toy size (~7 min)
#
# The default parts answer issue 38's open questions in one device command of at most 7 minutes (their
# limits add up to 420 s; expect about 4), leaving time in a 15-minute loan for the card's start-up and one rerun:
# first the `gpu` tests (does train.cuda_graphs capture, train as eager does and resume to the same bits),
# then the step against the plain loop eager and with graphs. Next, if time is left, in this order:
# PARTS="sample-graphs mfu-best" (sampling in graphs; the MFU with graphs and compiled blocks: at most
# 300 s), then PARTS="train-cl mfu-best-cl sample-cl" (train.channels_last and sample.channels_last: NHWC
# against NCHW, at most 450 s), then PARTS="train-graphs-compile mfu graphs" (graphs with compiled blocks
# against the plain loop; the eager MFU with its profile; the plain step graphed whole, and channels_last),
# then PARTS="sample-bf16 op-count".
# host-profile, sample-speed and growth were measured on earlier cards: PARTS="..." runs them.
# PYTHON picks the interpreter (default python3), e.g. PYTHON=.venv/bin/python after `make setup`.
# On a lent GPU machine: `python benchmarks/gpu_wheels.py` here first, then this script with carry [".whl"].
set -u
OUT=${1:-benchmarks/results/gpu}
mkdir -p "$OUT"
LOG=$OUT/on_gpu.log
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
# A lent machine fetches nothing: the wheels of what its image lacks (dvc, dvclive, snakemake, the tests'
# references) travel in .whl, made here by `python benchmarks/gpu_wheels.py` and carried (carry: [".whl"]).
if [ -d .whl ] && ! "$PY" -c 'import dvclive' 2>/dev/null; then
    echo "=== installing the $(ls .whl/*.whl | wc -l) carried wheels into /tmp/site" | tee -a "$LOG"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        2>&1 | tee -a "$LOG"
    export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
# REHEARSE=1: every part (or PARTS) on this machine's CPU at a toy size: the same command lines with the
# overrides of toy_args after them (argparse keeps an option's last value), so that a part the code has
# broken since the last card fails here, not in a loan's minutes (tests/test_benchmarks.py runs it).
REHEARSE=${REHEARSE:-}
if [ -n "$REHEARSE" ]; then PARTS=${PARTS:-all}; else PARTS=${PARTS:-environment cuda-tests train-step train-graphs}; fi
toy_args() {  # toy_args SCRIPT: a benchmark's options for a toy size on the CPU
    local tiny="--device cpu --preset tiny --image-size 8 --channels 1"
    case "$1" in
        */train_step.py) echo "$tiny --batch 4 --steps 2 --rounds 1 --warmup 0" ;;
        */step_host_profile.py) echo "$tiny --batch 4 --steps 2 --warmup 0 --top 3" ;;
        */sample_speed.py) echo "$tiny --batch 4 --rounds 1 --warmup 0 --ddpm-images 2 --ddpm-rounds 1" ;;
        */op_count.py) echo "$tiny --batch 4 --steps 2" ;;
        */graph_step.py) echo "$tiny --batches 4 --steps 2 --rounds 1 --warmup 0 --modes eager,eager+cl" ;;  # graph: CUDA only
        */growth.py) echo "--device cpu --presets tiny --sizes 8 --batch 2 --steps 1 --rounds 1 --warmup 0" ;;
        */mfu.py) echo "--device cpu --presets tiny --image-size 8 --channels 1 --batches 4 --steps 1 --rounds 1 \
            --warmup 0 --profile-steps 1" ;;
    esac
}
part() {  # part SECONDS NAME COMMAND...: runs COMMAND under a time limit, logs it, never stops the script
    local limit=$1 name=$2; shift 2
    [[ " $PARTS " == *" $name "* || "$PARTS" == all ]] || return 0
    if [ -n "$REHEARSE" ]; then
        [ "$name" = environment ] && return 0  # nvidia-smi and the card's GroupNorm: nothing to rehearse
        # shellcheck disable=SC2046  # toy_args' words are options without spaces
        set -- "$@" $(toy_args "$2")
    fi
    echo "=== $name (limit ${limit}s): $*" | tee -a "$LOG"
    local t0=$SECONDS
    timeout --signal=INT --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
    echo "=== $name: exit ${PIPESTATUS[0]} after $((SECONDS - t0)) s" | tee -a "$LOG"
}
# The card, its driver and torch; and whether this torch's CUDA GroupNorm keeps NHWC (train.channels_last): at the source read on 2026-11-28 it
# returned NCHW whatever its input, so that eager NHWC pays transposes around every GroupNorm (docs/TRAINING.md).
part 30 environment bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv; \
    $PY -c 'import torch, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name())'; \
    $PY -c 'import torch; x = torch.randn(2, 64, 8, 8, device=\"cuda\").to(memory_format=torch.channels_last); \
print(\"GroupNorm keeps NHWC on CUDA:\", torch.nn.functional.group_norm(x, 32).is_contiguous(memory_format=torch.channels_last))'"
# The `gpu` tests: train.cuda_graphs captured (bf16 and fp16 against eager; killed and resumed to the same
# bits), no host sync in a step's draws and losses. -rA prints each test's outcome and its printed differences.
part 150 cuda-tests $PY -m pytest -q -rA -s -p no:cacheprovider -m gpu tests
common=(--device cuda --preset ddpm-cifar10 --image-size 32 --channels 3)
# Where the step waits on the host, ours and the plain loop (the first thing to read if the ratio below moved).
part 90 host-profile $PY benchmarks/step_host_profile.py "${common[@]}" --precision bf16 --steps 20 --top 15
# 20-step blocks: 5-step blocks of a ~60 ms step scattered too widely (H100, 2026-11-26).
part 120 train-step $PY benchmarks/train_step.py "${common[@]}" --precision bf16 --steps 20 --rounds 8 --warmup 1 \
    --modes plain,ddpmrepro,improved-diffusion --out "$OUT/train_step-bf16.json"
# Issue 38's item 2 in the loop itself: train.cuda_graphs; then (its own part, so that a failure of the
# combination keeps the first's numbers) with the compiled blocks inside the graph.
part 120 train-graphs $PY benchmarks/train_step.py "${common[@]}" --precision bf16 --steps 20 --rounds 8 --warmup 1 \
    --modes plain,ddpmrepro+graphs --out "$OUT/train_step-bf16-graphs.json"
# train.channels_last: the model and its images in NHWC, eager and graphed, against the plain loop in both layouts.
part 150 train-cl $PY benchmarks/train_step.py "${common[@]}" --precision bf16 --steps 20 --rounds 6 --warmup 1 \
    --modes plain,plain+cl,ddpmrepro,ddpmrepro+cl,ddpmrepro+graphs+cl --out "$OUT/train_step-bf16-cl.json"
part 180 train-graphs-compile $PY benchmarks/train_step.py "${common[@]}" --precision bf16 --steps 20 --rounds 6 \
    --warmup 1 --modes plain,ddpmrepro+graphs+compile --out "$OUT/train_step-bf16-graphs-compile.json"
part 120 sample-speed $PY benchmarks/sample_speed.py "${common[@]}" --compile --samplers ddim50 --rounds 6 \
    --out "$OUT/sample_speed-ddim50.json"
# Issue 38's item 4: sample.cuda_graphs (and with compiled blocks) against eager, images compared, at batch 250
# (500 a forward with guidance) and 1000.
part 150 sample-graphs $PY benchmarks/sample_speed.py "${common[@]}" --compile --graphs --samplers ddim50 --rounds 6 \
    --out "$OUT/sample_speed-ddim50-graphs.json"
# sample.precision: the network in bf16 (tensor cores), alone and in graphs, against eager fp32 (images compared).
part 150 sample-bf16 $PY benchmarks/sample_speed.py "${common[@]}" --graphs --precision bf16 --samplers ddim50 \
    --rounds 6 --out "$OUT/sample_speed-ddim50-graphs-bf16.json"
# sample.channels_last: eager, graphed, and graphed in bf16, each in NHWC, against eager NCHW (images compared).
part 150 sample-cl $PY benchmarks/sample_speed.py "${common[@]}" --graphs --precision bf16 --channels-last \
    --samplers ddim50 --rounds 6 --out "$OUT/sample_speed-ddim50-graphs-bf16-cl.json"
part 120 sample-graphs-1000 $PY benchmarks/sample_speed.py "${common[@]}" --graphs --samplers ddim50 --rounds 4 \
    --batch 1000 --out "$OUT/sample_speed-ddim50-graphs-b1000.json"
part 60 growth $PY benchmarks/growth.py --device cuda --batch 128 --precision bf16 --peak-tflops 989 --rounds 6 \
    --out "$OUT/growth-bf16.json"
# The card used: the step's FLOPs (FlopCounterMode) over its time over this card's bf16 GEMM rate, measured
# in the same run, at batch 128 and 512, for both paper presets (the datasheet's 989 TFLOP/s beside it),
# then 5 profiled steps of each: the kernels' time by kind (convolution, GroupNorm, attention, optimizer, ...).
part 120 mfu $PY benchmarks/mfu.py --device cuda --precision bf16 --presets ddpm-cifar10,iddpm-cifar10 \
    --batches 128,512 --steps 10 --rounds 6 --peak-tflops 989 --profile-steps 5 --out "$OUT/mfu-bf16.json"
# The same with the best options the loop has (graphs, compiled blocks) at batches that fill the card more.
part 150 mfu-best $PY benchmarks/mfu.py --device cuda --precision bf16 --presets ddpm-cifar10 --batches 128,512,1024 \
    --steps 10 --rounds 4 --peak-tflops 989 --cuda-graphs --compile blocks --out "$OUT/mfu-bf16-graphs-compile.json"
# And with channels_last too, at the batches that fill the card (the plain step in NHWC is in `graphs`).
part 150 mfu-best-cl $PY benchmarks/mfu.py --device cuda --precision bf16 --presets ddpm-cifar10 --batches 128,512,1024 \
    --steps 10 --rounds 4 --peak-tflops 989 --cuda-graphs --compile blocks --channels-last \
    --out "$OUT/mfu-bf16-graphs-compile-cl.json"
# The host's work per step counted (benchmarks/op_count.py): the ATen operations each loop dispatches, the
# graphed loop's outside its replays; exact, so one block each. On a CPU AdamW's foreach path adds ~610 reads.
part 90 op-count $PY benchmarks/op_count.py --device cuda --precision bf16 --model-channels 0 --batch 128 \
    --out "$OUT/op_count-bf16.json"
# Does capturing the whole step in a CUDA graph (or compile's reduce-overhead) pay, and at which batch
# (issue 38, item 2): the plain step three ways, each checked against eager after 3 steps first.
part 150 graphs $PY benchmarks/graph_step.py --device cuda --precision bf16 --batches 128,512 --steps 20 --rounds 6 \
    --modes eager,graph,compile,eager+cl,graph+cl \
    --out "$OUT/graph_step-bf16.json"

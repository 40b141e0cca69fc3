#!/usr/bin/env bash
# Every check that needs a GPU, in one call of the device tool (docs/development.md: "On a GPU machine").
#
# Here, first:   make device-kit            (.device/: wheels for that machine's Python, RabbitMQ)
# Then call the device tool's run with      command: bash scripts/device-check.sh
#                                           carry: [".device"], timeout_s: 590
#
# The stages run in order of what the open issues need most, each under its own time limit and
# all under one deadline (DEADLINE_S, 540 s from the start): a stage that hangs costs only its own
# minutes, and one that would start too late is skipped. After every stage three files are
# rewritten in $OUT (the tool brings back at most 8): summary.txt (the table of stages and the
# figures the issues ask for, also printed last), results.json (each benchmark's JSON by stage)
# and logs.txt (every stage's log).
#
#   env          the GPU, torch, and fedmq's dependencies from .device/wheels where they are missing
#   broker       a RabbitMQ node of its own (scripts/device-broker.sh); stages marked [mq] need it
#   fused        benchmarks/fused.py --device cuda: the fused kernel against the sequential loop (issue 18)
#   gpu_round    benchmarks/gpu_round.py: a 202 MB model's round on the GPU, outside training (issue 16)
#   gpu_tests    the tests that run on CUDA where torch sees a GPU (devices, codec, fused)
#   scaling      [mq] benchmarks/learner_scaling.py: 1, 2, 4, 8 CPU learner processes (issue 16)
#   gpu_round_mq [mq] gpu_round.py over RabbitMQ, real service processes
#   fused_run    benchmarks/fused_run.py with FEDMQ_DEVICE=cuda: `fedmq run`, fused against unfused
#                (its plain-loop baseline trains on the CPU)
#   suite        the tests that need no end-to-end cluster: -m "not slow" with a broker, else
#                -m "not rabbitmq and not slow"; whatever time is left
#
# STAGES="fused gpu_round" runs only those. A dry run on a machine without a GPU (small sizes, a
# second broker node beside the machine's own):
#   DEVICE=cpu PYTHON=.venv/bin/python GPU_ROUND_ARGS="--width 256 --depth 2" \
#   SCALING_ARGS="--learners 1,2 --epochs 2 --rounds 5" FEDMQ_DEVICE_BROKER_PORT=25999 \
#   RABBITMQ_NODENAME=fedmq-dry@localhost bash scripts/device-check.sh
set -uo pipefail
START=$(date +%s)
DEADLINE=$(( START + ${DEADLINE_S:-540} ))
OUT=${OUT:-/tmp/fedmq-device-out}
WORK=$(mktemp -d /tmp/fedmq-device-XXXX)  # each stage's log and JSON, gathered into $OUT
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HYPOTHESIS_STORAGE_DIRECTORY="$WORK/hypothesis"
export HOME=${HOME:-/root}  # Erlang keeps its cookie there
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
STAGES=${STAGES:-"fused gpu_round gpu_tests scaling gpu_round_mq fused_run suite"}
BROKER=0
STARTED_BROKER=0
: > "$WORK/stages.txt"

wanted() { [[ " $STAGES " == *" $1 "* ]]; }

row() { printf '%-13s %-8s %4ss\n' "$1" "$2" "$3" >> "$WORK/stages.txt"; }

gather() {  # $OUT from what $WORK holds now
    for log in "$WORK"/*.log; do
        [ -f "$log" ] && printf '\n===== %s\n' "$(basename "$log")" && cat "$log"
    done > "$OUT/logs.txt"
    { echo "== stages ($(( $(date +%s) - START ))s in all)"; cat "$WORK/stages.txt"
      "$PY" scripts/device_summary.py "$WORK" "$OUT/results.json"; } > "$OUT/summary.txt" 2>&1
}

finish() {
    gather
    cat "$OUT/summary.txt"
    if [ "$STARTED_BROKER" = 1 ] && [ -z "${KEEP_BROKER:-}" ]; then
        rabbitmqctl -q stop > /dev/null 2>&1 || true
    fi
    rm -rf "$WORK"
}
trap finish EXIT

stage() {  # stage NAME SECONDS COMMAND...: output in $WORK/NAME.log, a row in the table
    local name=$1 limit=$2 began left rc pid
    shift 2
    wanted "$name" || return 0
    began=$(date +%s)
    left=$(( DEADLINE - began ))
    if [ "$left" -lt 30 ]; then
        row "$name" skipped 0
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name (at most ${limit}s)"
    # timeout leads a process group of its own: whatever the stage started dies with it.
    timeout -k 5 "$limit" "$@" > "$WORK/$name.log" 2>&1 &
    pid=$!
    wait "$pid"
    rc=$?
    kill -KILL -- "-$pid" 2> /dev/null
    row "$name" "rc=$rc" "$(( $(date +%s) - began ))"
    tail -3 "$WORK/$name.log"
    gather
    return 0
}

{
    nvidia-smi -L || true
    nproc
    "$PY" -c "import torch, sys; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-')"
} > "$WORK/env.log" 2>&1
cat "$WORK/env.log"
export PYTHONPATH=$PWD
if ! "$PY" -c "import pika, pydantic_settings, structlog, opacus" 2> /dev/null; then
    # Wheels are zip files laid out for site-packages: unpacked, they are installed (no pip needed).
    "$PY" -c "import sys, zipfile; [zipfile.ZipFile(w).extractall('/tmp/fedmq-site') for w in sys.argv[1:]]" \
        .device/wheels/*.whl >> "$WORK/env.log" 2>&1
    export PYTHONPATH=/tmp/fedmq-site:$PWD
fi
if ! "$PY" -c "import fedmq, pika, pydantic_settings, structlog; print('fedmq', fedmq.__version__)" >> "$WORK/env.log" 2>&1; then
    row env failed "$(( $(date +%s) - START ))"
    exit 1
fi
if [ "$DEVICE" = cuda ] && ! "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    echo "torch sees no GPU here: DEVICE=cpu for a dry run" >> "$WORK/env.log"
    row env "no GPU" "$(( $(date +%s) - START ))"
    exit 1
fi
row env ok "$(( $(date +%s) - START ))"

if wanted scaling || wanted gpu_round_mq || wanted suite; then
    began=$(date +%s)
    # shellcheck source=scripts/device-broker.sh
    if source scripts/device-broker.sh .device > "$WORK/broker.log" 2>&1; then
        BROKER=1
        grep -q "already up" "$WORK/broker.log" || STARTED_BROKER=1
    fi
    row broker "$([ "$BROKER" = 1 ] && echo ok || echo failed)" "$(( $(date +%s) - began ))"
    tail -3 "$WORK/broker.log"
fi

mq() {  # a stage that needs the broker: skipped without one
    if [ "$BROKER" = 1 ]; then stage "$@"; elif wanted "$1"; then row "$1" "no broker" 0; fi
}

stage fused 120 "$PY" benchmarks/fused.py --device "$DEVICE" --rounds 8
# shellcheck disable=SC2086 # the ARGS are word lists
stage gpu_round 150 "$PY" benchmarks/gpu_round.py --device "$DEVICE" --rounds 4 ${GPU_ROUND_ARGS:-}
stage gpu_tests 150 "$PY" -m pytest -q -p no:cacheprovider -rs tests/integration/test_devices.py \
    tests/unit/test_device.py tests/unit/test_codec_tensors.py tests/unit/test_fused.py
# shellcheck disable=SC2086
mq scaling 200 "$PY" benchmarks/learner_scaling.py ${SCALING_ARGS:---learners 1,2,4,8}
# shellcheck disable=SC2086
mq gpu_round_mq 150 "$PY" benchmarks/gpu_round.py --device "$DEVICE" --bus rabbitmq --rounds 4 ${GPU_ROUND_ARGS:-}
stage fused_run 180 env FEDMQ_DEVICE="$DEVICE" "$PY" benchmarks/fused_run.py --rounds 8
if [ "$BROKER" = 1 ]; then
    stage suite 600 "$PY" -m pytest -q -p no:cacheprovider -n 8 -m "not slow and not soak"
else
    stage suite 600 "$PY" -m pytest -q -p no:cacheprovider -n 8 -m "not rabbitmq and not slow"
fi

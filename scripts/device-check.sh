#!/usr/bin/env bash
# Every check that needs a GPU, in one call of the device tool (README: "On a GPU machine").
#
# Here, first:   make device-kit            (.device/: wheels for that machine's Python, RabbitMQ)
# Then call the device tool's run with      command: bash scripts/device-check.sh
#                                           carry: [".device"], timeout_s: 590
#
# Runs the stages in order, each under its own time limit, so that one that hangs costs only its
# own minutes. Three files land in $OUT (the tool brings back at most 8): results.json (each
# benchmark's JSON by stage), logs.txt (every stage's log) and summary.txt (the table of stages and
# the figures the open issues ask for, also printed last).
#
#   env          the GPU, torch, and fedmq's dependencies installed from .device/wheels
#   broker       a RabbitMQ node of its own (scripts/device-broker.sh); the stages marked [mq] need it
#   gpu_tests    the tests that run on CUDA where torch sees a GPU (device, codec, fused, test_devices)
#   fused        benchmarks/fused.py --device cuda: the fused kernel against the sequential loop (issue 18)
#   fused_run    benchmarks/fused_run.py with FEDMQ_DEVICE=cuda: `fedmq run`, fused against unfused
#   gpu_round    benchmarks/gpu_round.py: a 200 MB model's round on the GPU, outside training (issue 16)
#   gpu_round_mq [mq] the same over RabbitMQ with real service processes
#   scaling      [mq] benchmarks/learner_scaling.py: 1, 2, 4, 8 CPU learner processes (issue 16)
#   suite        the tests that need no end-to-end cluster, on that machine: -m "not slow" (with a
#                broker), else -m "not rabbitmq and not slow"
#
# STAGES="fused gpu_round" runs only those (env always runs; broker when a named stage needs it).
# A dry run here: DEVICE=cpu PYTHON=.venv/bin/python GPU_ROUND_ARGS="--width 256 --depth 2" \
#   SCALING_ARGS="--learners 1,2 --epochs 2" FEDMQ_DEVICE_BROKER_PORT=25999 bash scripts/device-check.sh
set -uo pipefail
OUT=${OUT:-/tmp/fedmq-device-out}
WORK=$(mktemp -d /tmp/fedmq-device-XXXX)  # each stage's log and JSON; gathered into $OUT at the end
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}  # DEVICE=cpu: a dry run of the script on a machine without a GPU
STAGES=${STAGES:-"gpu_tests fused fused_run gpu_round gpu_round_mq scaling suite"}
RESULTS=()

wanted() { [[ " $STAGES " == *" $1 "* ]]; }

stage() {  # stage NAME SECONDS COMMAND...: its output in $WORK/NAME.log, its status in the table
    local name=$1 limit=$2 began rc
    shift 2
    wanted "$name" || return 0
    began=$(date +%s)
    echo "== $name (at most ${limit}s)"
    timeout -k 10 "$limit" "$@" > "$WORK/$name.log" 2>&1
    rc=$?
    RESULTS+=("$(printf '%-13s rc=%-4s %4ss' "$name" "$rc" "$(( $(date +%s) - began ))")")
    tail -3 "$WORK/$name.log"
    return $rc
}

json() {  # json NAME: the last JSON object a benchmark printed, into $WORK/NAME.json
    [ -f "$WORK/$1.log" ] || return 0
    "$PY" - "$WORK/$1.log" > "$WORK/$1.json" <<'EOF'
import json, sys
text = open(sys.argv[1]).read()
start = text.rfind("\n{")
print(json.dumps(json.loads(text[start + 1 if start >= 0 else text.index("{"):]), indent=1))
EOF
}

{
    nvidia-smi -L || true
    "$PY" -c "import torch, sys; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-')"
    nproc
} > "$WORK/env.log" 2>&1
cat "$WORK/env.log"
export PYTHONPATH=$PWD
if ! "$PY" -c "import pika, pydantic_settings, structlog, opacus" 2> /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/fedmq-site \
        .device/wheels/*.whl >> "$WORK/env.log" 2>&1 || { cp "$WORK/env.log" "$OUT/logs.txt"; echo "wheels did not install: logs.txt"; exit 1; }
    export PYTHONPATH=/tmp/fedmq-site:$PWD
fi
"$PY" -c "import fedmq, pika, pydantic_settings, structlog; print('fedmq', fedmq.__version__)" >> "$WORK/env.log" 2>&1 \
    || { cp "$WORK/env.log" "$OUT/logs.txt"; tail -5 "$WORK/env.log"; exit 1; }

BROKER=0
if wanted gpu_round_mq || wanted scaling || wanted suite; then
    began=$(date +%s)
    # shellcheck source=scripts/device-broker.sh
    if source scripts/device-broker.sh .device > "$WORK/broker.log" 2>&1; then BROKER=1; fi
    RESULTS+=("$(printf '%-13s rc=%-4s %4ss' broker "$((1 - BROKER))" "$(( $(date +%s) - began ))")")
    tail -3 "$WORK/broker.log"
fi

stage gpu_tests 150 "$PY" -m pytest -q -p no:cacheprovider tests/integration/test_devices.py \
    tests/unit/test_device.py tests/unit/test_codec_tensors.py tests/unit/test_fused.py
stage fused 120 "$PY" benchmarks/fused.py --device "$DEVICE" --rounds 8 && json fused
stage fused_run 180 env FEDMQ_DEVICE="$DEVICE" "$PY" benchmarks/fused_run.py --rounds 8 && json fused_run
stage gpu_round 150 "$PY" benchmarks/gpu_round.py --device "$DEVICE" --rounds 4 ${GPU_ROUND_ARGS:-} && json gpu_round
if [ "$BROKER" = 1 ]; then
    stage gpu_round_mq 150 "$PY" benchmarks/gpu_round.py --device "$DEVICE" --bus rabbitmq --rounds 4 ${GPU_ROUND_ARGS:-} && json gpu_round_mq
    stage scaling 240 "$PY" benchmarks/learner_scaling.py ${SCALING_ARGS:---learners 1,2,4,8} && json scaling
    stage suite 300 "$PY" -m pytest -q -p no:cacheprovider -n 8 -m "not slow and not soak"
else
    stage suite 300 "$PY" -m pytest -q -p no:cacheprovider -n 8 -m "not rabbitmq and not slow"
fi

for log in "$WORK"/*.log; do printf '\n===== %s\n' "$(basename "$log")"; cat "$log"; done > "$OUT/logs.txt"
{
echo "== stages"
printf '%s\n' "${RESULTS[@]}"
"$PY" - "$WORK" "$OUT/results.json" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
Path(sys.argv[2]).write_text(json.dumps({p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*.json"))}, indent=1))
def load(name):
    path = out / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None
rows = []
if (f := load("fused")):
    c = f["cases"]["100_clients_per_round"]
    rows.append(("kernel, 100 clients: sequential / fused (target >= 10)", f"{c['sequential_loop_baseline_round_s'] / c['fused_round_s']:.1f}x"))
if (f := load("fused_run")):
    for case in ("10_clients_per_round", "100_clients_per_round"):
        if case in f:
            c = f[case]
            rows.append((f"fedmq run {case}: unfused / fused", f"{c['unfused_round_s'] / c['fused_round_s']:.1f}x ({c['fused_round_s']:.3f} s)"))
for name in ("gpu_round", "gpu_round_mq"):
    if (g := load(name)):
        rows.append((f"{name}: outside training, {g['model_mb']} MB (target <= 1 s)", f"{g['outside_training_s_median']:.2f} s of {g['round_s_median']:.2f} s"))
if (s := load("scaling")):
    rows.append(("learners 1 -> 8 throughput (target >= 6)", str({k: v["throughput_over_first"] for k, v in s["runs"].items()})))
for what, figure in rows:
    print(f"{what:62s} {figure}")
EOF
} 2>&1 | tee "$OUT/summary.txt"

#!/usr/bin/env bash
# What the GPU machine of the device tool lacks, packed here into .device/ (git-ignored; carried
# with the call as `carry: [".device"]`): scripts/device-check.sh installs and starts it there.
#
#   .device/wheels/     fedmq's dependencies that image does not hold (pika, pydantic and
#                       pydantic-settings, structlog, opacus), as wheels for its Python (3.12),
#                       at the versions this venv runs
#   .device/rabbit.tar.xz   Erlang and RabbitMQ as installed here (/usr/lib/erlang, /usr/lib/rabbitmq),
#                       for scripts/device-broker.sh; skipped when they are not installed here
#
# Usage: scripts/device-kit.sh [python-of-the-venv]   (make device-kit)
set -euo pipefail
python=${1:-.venv/bin/python}
kit=.device
pyver=${FEDMQ_DEVICE_PYTHON:-3.12}
mkdir -p "$kit/wheels"
rm -f "$kit"/wheels/*.whl
# Pure-Python wheels, but pydantic-core's is compiled: ask for the other machine's Python and platform.
# Versions pinned to this venv's, so that what runs there is what the tests here ran.
wanted="pika pydantic pydantic_core pydantic-settings python-dotenv annotated-types typing-inspection
typing_extensions structlog opacus"
pins=()
for name in $wanted; do
    pins+=("$name==$("$python" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")")
done
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$kit/wheels" "${pins[@]}"
if [ -x /usr/lib/rabbitmq/bin/rabbitmq-server ] && [ -d /usr/lib/erlang ]; then
    if [ ! -f "$kit/rabbit.tar.xz" ]; then  # ~34 MB, half a minute: kept between kits
        tar -cJf "$kit/rabbit.tar.xz" -C / usr/lib/erlang usr/lib/rabbitmq
    fi
else
    echo "device-kit: no RabbitMQ installed here; the device checks that need a broker will skip" >&2
fi
du -sh "$kit"/wheels "$kit"/rabbit.tar.xz 2>/dev/null || true

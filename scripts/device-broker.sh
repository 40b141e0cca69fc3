#!/usr/bin/env bash
# A RabbitMQ node of its own on 127.0.0.1:$FEDMQ_DEVICE_BROKER_PORT (5672), for a machine with no
# broker installed: the GPU machine of the device tool, which gets Erlang and RabbitMQ from the
# kit's rabbit.tar.xz (scripts/device-kit.sh), unpacked under /usr/lib where they were packed.
#
#   source scripts/device-broker.sh [kit-folder]
#
# Exports what rabbitmqctl needs to find the node (PATH, RABBITMQ_NODENAME, ...) and the tests' broker
# URL (FEDMQ_TEST_BROKER_URL, guest/guest from loopback as on a developer's machine). Everything the
# node writes stays under $FEDMQ_DEVICE_BROKER_HOME (/tmp/fedmq-rabbit). `rabbitmqctl stop` stops it.
# Returns non-zero (and says why) when the node does not come up; sourcing goes on either way.

_fedmq_broker() {
    local kit=${1:-.device}
    local port=${FEDMQ_DEVICE_BROKER_PORT:-5672}
    local home=${FEDMQ_DEVICE_BROKER_HOME:-/tmp/fedmq-rabbit}
    if [ ! -x /usr/lib/rabbitmq/bin/rabbitmq-server ]; then
        if [ ! -f "$kit/rabbit.tar.xz" ]; then
            echo "device-broker: no RabbitMQ here and no $kit/rabbit.tar.xz (make device-kit)" >&2
            return 1
        fi
        tar -xJf "$kit/rabbit.tar.xz" -C / || return 1
    fi
    export PATH="/usr/lib/rabbitmq/bin:/usr/lib/erlang/bin:$PATH"
    export RABBITMQ_NODENAME=${RABBITMQ_NODENAME:-fedmq@localhost}
    export RABBITMQ_DIST_PORT=${RABBITMQ_DIST_PORT:-$((port + 20000))}
    export ERL_EPMD_ADDRESS=127.0.0.1 ERL_CRASH_DUMP="$home/erl_crash.dump"
    mkdir -p "$home"
    printf 'listeners.tcp.default = 127.0.0.1:%s\nloopback_users.guest = true\n' "$port" > "$home/rabbitmq.conf"
    echo '[].' > "$home/enabled_plugins"
    : > "$home/rabbitmq-env.conf"
    # rabbitmqctl reads these too: export them for the tests' calls as well as the server's.
    export RABBITMQ_CONF_ENV_FILE="$home/rabbitmq-env.conf" RABBITMQ_CONFIG_FILE="$home/rabbitmq.conf"
    export RABBITMQ_ENABLED_PLUGINS_FILE="$home/enabled_plugins" RABBITMQ_MNESIA_BASE="$home/mnesia"
    export RABBITMQ_LOG_BASE="$home/log" RABBITMQ_PID_FILE="$home/pid"
    export FEDMQ_TEST_BROKER_URL=${FEDMQ_TEST_BROKER_URL:-amqp://guest:guest@127.0.0.1:$port/}
    if rabbitmqctl -q status > /dev/null 2>&1; then
        echo "device-broker: $RABBITMQ_NODENAME already up"
        return 0
    fi
    setsid rabbitmq-server > "$home/server.out" 2>&1 < /dev/null &
    if ! rabbitmqctl -q wait "$home/pid" --timeout 60 > /dev/null 2>&1; then
        echo "device-broker: the node did not start; $home/server.out says:" >&2
        tail -20 "$home/server.out" >&2
        return 1
    fi
    echo "device-broker: RabbitMQ $RABBITMQ_NODENAME on 127.0.0.1:$port"
}

_fedmq_broker "$@"

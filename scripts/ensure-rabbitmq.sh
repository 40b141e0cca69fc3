#!/usr/bin/env bash
# Start the local RabbitMQ when it is installed but not running. Never fails on its own:
# the RabbitMQ tests decide whether a missing broker is a skip (laptop) or a failure (CI=1, yes or true).
# FEDMQ_NO_INSTALL=1: start nothing, only say that the broker is not running.
set -u
if ! command -v rabbitmq-server >/dev/null 2>&1; then
  echo "ensure-rabbitmq: rabbitmq-server is not installed; RabbitMQ tests will skip (or fail under CI=1|yes|true)" >&2
  exit 0
fi
if rabbitmq-diagnostics -q ping >/dev/null 2>&1; then
  exit 0
fi
if [ "${FEDMQ_NO_INSTALL:-0}" = 1 ]; then
  echo "ensure-rabbitmq: RabbitMQ is installed but not running; not starting it (FEDMQ_NO_INSTALL=1):" \
    "RabbitMQ tests will skip (or fail under CI=1|yes|true)" >&2
  exit 0
fi
echo "ensure-rabbitmq: starting the local broker, for the RabbitMQ tests: rabbitmq-server -detached" \
  "(it keeps running after the tests; FEDMQ_NO_INSTALL=1 to skip)" >&2
rabbitmq-server -detached >/dev/null 2>&1 || true
for _ in $(seq 1 60); do
  if rabbitmq-diagnostics -q ping >/dev/null 2>&1; then
    echo "ensure-rabbitmq: broker is up" >&2
    exit 0
  fi
  sleep 1
done
echo "ensure-rabbitmq: broker did not answer within 60 s" >&2
exit 0

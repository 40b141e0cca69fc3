#!/usr/bin/env bash
# Install the command-line tools the deployment tests use, when missing and we can:
# promtool (Debian's prometheus) checks the Prometheus config and dashboard queries,
# docker-compose validates compose.yaml, chromium (Debian's browser) is what the console's browser
# test drives headless. Without them those tests skip loudly, or fail
# under CI (CI=1, yes or true). --no-install-recommends keeps docker-compose from pulling in a Docker engine.
# FEDMQ_NO_INSTALL=1: install nothing, only say what is missing.
set -u
missing=()
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
command -v docker-compose >/dev/null 2>&1 || missing+=(docker-compose)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
[ ${#missing[@]} -eq 0 ] && exit 0
why="the deployment tests use promtool (package prometheus) and docker-compose, the console's browser test chromium; without them those tests skip (or fail under CI=1|yes|true)"
if [ "${FEDMQ_NO_INSTALL:-0}" = 1 ]; then
  echo "ensure-tools: missing ${missing[*]}; not installing them (FEDMQ_NO_INSTALL=1): $why" >&2
  exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "ensure-tools: missing ${missing[*]} and cannot apt-get install here: $why" >&2
  exit 0
fi
echo "ensure-tools: installing ${missing[*]} as root with apt-get (FEDMQ_NO_INSTALL=1 to skip): $why" >&2
apt-get update -qq >/dev/null 2>&1
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null 2>&1 \
  || echo "ensure-tools: apt-get install ${missing[*]} failed; those tests will skip (or fail under CI=1|yes|true)" >&2
exit 0

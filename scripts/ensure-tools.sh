#!/usr/bin/env bash
# Install the command-line tools the deployment tests use, when missing and we can:
# promtool (Debian's prometheus) checks the Prometheus config and dashboard queries,
# docker-compose validates compose.yaml. Without them those tests skip loudly, or fail
# under CI (CI=1, yes or true). --no-install-recommends keeps docker-compose from pulling in a Docker engine.
set -u
missing=()
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
command -v docker-compose >/dev/null 2>&1 || missing+=(docker-compose)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "ensure-tools: missing ${missing[*]} and cannot apt-get install here; those tests will skip" >&2
  exit 0
fi
echo "ensure-tools: apt-get install ${missing[*]}" >&2
apt-get update -qq >/dev/null 2>&1
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null 2>&1 \
  || echo "ensure-tools: apt-get install ${missing[*]} failed; those tests will skip (or fail under CI=1|yes|true)" >&2
exit 0

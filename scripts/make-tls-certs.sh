#!/usr/bin/env bash
# Certificates for TLS between fedmq and RabbitMQ, made with openssl:
#
#   scripts/make-tls-certs.sh [DIR [BROKER_NAME...]]      (default: deploy/tls rabbitmq localhost)
#
#   DIR/ca.key, DIR/ca.pem              a CA of your own: keep ca.key somewhere safe, offline
#   DIR/rabbitmq/{ca,server}.pem, server.key   the broker's, named by every BROKER_NAME (DNS)
#   DIR/fedmq/{ca,client}.pem, client.key      the services' client certificate (CN=fedmq-services)
#
# deploy/compose.tls.yaml mounts DIR/rabbitmq into the broker and DIR/fedmq into every service.
# Keys are unencrypted P-256 keys (mode 600): give each to the user its container runs as
# (deploy/rabbitmq/README.md, "TLS"). Valid for DAYS days (825 unless DAYS is set).
set -euo pipefail
dir=${1:-deploy/tls}
shift || true
names=("$@")
[ ${#names[@]} -gt 0 ] || names=(rabbitmq localhost)
days=${DAYS:-825}
key=(-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes)
leaf_ext="basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
subjectKeyIdentifier=hash
authorityKeyIdentifier=keyid,issuer"

umask 077
mkdir -p "$dir/rabbitmq" "$dir/fedmq"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if [ ! -f "$dir/ca.key" ]; then
  openssl req -x509 "${key[@]}" -days "$days" -keyout "$dir/ca.key" -out "$dir/ca.pem" \
    -subj "/CN=fedmq CA" -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
fi

sign() {  # sign NAME SUBJECT EXTENSIONS OUT_DIR
  openssl req "${key[@]}" -keyout "$4/$1.key" -out "$work/$1.csr" -subj "$2" 2>/dev/null
  printf '%s\n%s\n' "$leaf_ext" "$3" > "$work/$1.ext"
  openssl x509 -req -in "$work/$1.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca.key" -CAcreateserial \
    -CAserial "$work/ca.srl" -days "$days" -extfile "$work/$1.ext" -out "$4/$1.pem" 2>/dev/null
}

san=$(printf 'DNS:%s,' "${names[@]}")
sign server "/CN=${names[0]}" "subjectAltName=${san%,}
extendedKeyUsage=serverAuth" "$dir/rabbitmq"
sign client "/CN=fedmq-services" "extendedKeyUsage=clientAuth" "$dir/fedmq"
cp "$dir/ca.pem" "$dir/rabbitmq/ca.pem"
cp "$dir/ca.pem" "$dir/fedmq/ca.pem"
chmod 644 "$dir"/ca.pem "$dir"/rabbitmq/*.pem "$dir"/fedmq/*.pem
chmod 755 "$dir" "$dir/rabbitmq" "$dir/fedmq"
echo "certificates in $dir: the broker's in rabbitmq/ (names: ${names[*]}), the services' in fedmq/" >&2

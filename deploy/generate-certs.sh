#!/usr/bin/env bash
# Generate what a TLS deployment of flwr-corrnoise needs (docs/deployment.md):
#   ca.crt / ca.key            a self-signed certificate authority (keep ca.key offline)
#   server.pem / server.key    the SuperLink's certificate, signed by the CA, for the
#                              names in SERVER_NAMES (default: localhost and 127.0.0.1)
#   supernode-<i>.key / .pub   one P-384 key pair per SuperNode (SuperNode authentication:
#                              the SuperLink only admits registered public keys, and a
#                              restarted SuperNode keeps its node id)
#
# usage: deploy/generate-certs.sh OUT_DIR [NUM_SUPERNODES]
#        SERVER_NAMES="DNS:link.example.org,IP:10.0.0.5" deploy/generate-certs.sh OUT_DIR 3
#
# Every SuperNode gets ca.crt (to verify the SuperLink) and its own supernode-<i>.key;
# the SuperLink gets ca.crt, server.pem and server.key. Needs openssl, and the Python with
# flwr installed ($PYTHON, default python3) for the SuperNode keys.
# The app publisher's signing key (which FABs the SuperNodes run) is made separately:
# python -m deploy.trusted_apps keygen DIR (docs/deployment.md, "App code the operator trusts").
set -euo pipefail

out="${1:?usage: $0 OUT_DIR [NUM_SUPERNODES]}"
nodes="${2:-0}"
names="${SERVER_NAMES:-DNS:localhost,IP:127.0.0.1,IP:::1}"
days="${CERT_DAYS:-365}"

mkdir -p "$out"
cd "$out"
umask 077

openssl genrsa -out ca.key 4096 2>/dev/null
openssl req -new -x509 -key ca.key -sha256 -days "$days" \
    -subj "/O=flwr-corrnoise/CN=flwr-corrnoise local CA" -out ca.crt

openssl genrsa -out server.key 4096 2>/dev/null
openssl req -new -key server.key -subj "/O=flwr-corrnoise/CN=flwr-corrnoise SuperLink" \
    -out server.csr
cat > server.ext <<EXT
basicConstraints = CA:FALSE
keyUsage = digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth
subjectAltName = $names
EXT
openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial \
    -days "$days" -sha256 -extfile server.ext -out server.pem 2>/dev/null
rm -f server.csr server.ext ca.srl

# SuperNode keys in OpenSSH format, as flower-supernode and `flwr supernode register` read
# them; made with `cryptography` (installed with flwr) so no ssh-keygen is needed.
if ((nodes > 0)); then
    "${PYTHON:-python3}" - "$nodes" <<'PY'
import sys
from cryptography.hazmat.primitives import serialization as s
from cryptography.hazmat.primitives.asymmetric import ec

for i in range(int(sys.argv[1])):
    key = ec.generate_private_key(ec.SECP384R1())
    with open(f"supernode-{i}.key", "wb") as fh:
        fh.write(key.private_bytes(s.Encoding.PEM, s.PrivateFormat.OpenSSH, s.NoEncryption()))
    with open(f"supernode-{i}.pub", "wb") as fh:
        fh.write(key.public_key().public_bytes(s.Encoding.OpenSSH, s.PublicFormat.OpenSSH))
PY
fi
chmod 644 ca.crt server.pem supernode-*.pub 2>/dev/null || true

openssl verify -CAfile ca.crt server.pem >/dev/null
echo "certificates in $(pwd): ca.crt server.pem server.key${nodes:+ and $nodes SuperNode key pairs}"

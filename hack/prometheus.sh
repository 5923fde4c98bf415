#!/usr/bin/env bash
# Prints the path of a Prometheus 2.x server binary for the engine tier's dashboard
# test, installing Debian's `prometheus` package (2.42 on bookworm) when none is on
# PATH. Idempotent: a second run only prints the path.
#
#   hack/prometheus.sh            # -> /usr/bin/prometheus
#
# Installing needs root (CI runs as root); anyone else gets the command to run.
# Measured here: apt-get update + install ~20 s (2 cores); once installed, ~0.01 s.
set -euo pipefail

if bin=$(command -v prometheus); then
  echo "$bin"
  exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
  echo "prometheus is not installed; as root run:" >&2
  echo "  apt-get update && apt-get install -y --no-install-recommends prometheus" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >&2
# --no-install-recommends: no node exporter, no systemd units started (none run here).
apt-get install -y -qq --no-install-recommends prometheus >&2
command -v prometheus

#!/usr/bin/env bash
# Creates (or reuses) a Cloud TPU VM pod slice, installs this repository on every worker, and runs
# the same training command on all of them. jax.distributed.initialize() is automatic on TPU pods.
#
#   launch/tpu_pod.sh NAME ZONE ACCELERATOR CONFIG WORKDIR [--config.x=v ...]
#   launch/tpu_pod.sh rf-v5p us-east5-a v5p-64 configs/resformer_468m.py gs://bucket/runs/r468
#   launch/tpu_pod.sh rf-7b us-east5-a v5p-128 configs/svformer_7b.py:v5p-128 gs://bucket/runs/sv7b
#
# The config's mesh is used as it is: the scale-out presets carry each cluster's (CONFIG:v5p-128 or :v6e-64;
# docs/scaling-out.md), the paper presets put every chip on the data axis.
# WORKDIR should be a GCS path so every worker sees the same run: checkpoints, TensorBoard events,
# metrics.jsonl (in segments), config and evaluation outputs all go there (the tpu extra installs gcsfs).
# The prepared corpus must be on each worker's local disk (ArrayRecord reads local files): set
# DATA_FROM=gs://bucket/corpus and it is copied to DATA_DIR (default ~/corpus, a path under the home folder) on every worker and used
# as config.data.path (or mount the bucket with gcsfuse and pass --config.data.path yourself).
# Rerunning resumes from the newest checkpoint; preemption (SIGTERM) saves at a step that all
# hosts agree on through JAX's preemption sync point.
set -euo pipefail
if [ $# -lt 5 ]; then
  echo "usage: $0 NAME ZONE ACCELERATOR CONFIG WORKDIR [overrides]" >&2
  exit 2
fi
NAME=$1; ZONE=$2; ACCEL=$3; CONFIG=$4; WORKDIR=$5; shift 5
# The TPU VM runtime image each generation needs (Cloud TPU's software versions); TPU_SOFTWARE_VERSION overrides.
case "$ACCEL" in
  v5litepod-*|v5e-*) DEFAULT_VERSION=v2-alpha-tpuv5-lite ;;
  v5p-*)             DEFAULT_VERSION=v2-alpha-tpuv5 ;;
  v6e-*)             DEFAULT_VERSION=v2-alpha-tpuv6e ;;
  v4-*|v3-*|v2-*)    DEFAULT_VERSION=tpu-ubuntu2204-base ;;
  *) echo "error: unknown accelerator type $ACCEL; set TPU_SOFTWARE_VERSION to its runtime version" >&2; exit 2 ;;
esac
VERSION=${TPU_SOFTWARE_VERSION:-$DEFAULT_VERSION}
REPO_URL=${REPO_URL:-$(git config --get remote.origin.url || true)}
BRANCH=${BRANCH:-main}

if ! gcloud compute tpus tpu-vm describe "$NAME" --zone="$ZONE" >/dev/null 2>&1; then
  echo "creating TPU VM $NAME ($ACCEL) in $ZONE"
  gcloud compute tpus tpu-vm create "$NAME" --zone="$ZONE" --accelerator-type="$ACCEL" --version="$VERSION" \
    ${TPU_SPOT:+--spot}
else
  echo "reusing TPU VM $NAME"
fi

ssh_all() { gcloud compute tpus tpu-vm ssh "$NAME" --zone="$ZONE" --worker=all --command="$1"; }

if [ -n "$REPO_URL" ]; then
  ssh_all "set -e; if [ ! -d resformer_jax ]; then git clone -b $BRANCH $REPO_URL resformer_jax; fi;
    cd resformer_jax && git fetch -q && git checkout -q $BRANCH && git pull -q;
    python3 -m venv .venv && .venv/bin/pip install -q -U pip && .venv/bin/pip install -q -e '.[tpu]'"
else
  echo "no git remote: copying this checkout to every worker"
  tar czf /tmp/resformer_jax.tgz --exclude=.venv --exclude=runs .
  gcloud compute tpus tpu-vm scp /tmp/resformer_jax.tgz "$NAME":~ --zone="$ZONE" --worker=all
  ssh_all "set -e; mkdir -p resformer_jax && tar xzf resformer_jax.tgz -C resformer_jax && cd resformer_jax &&
    python3 -m venv .venv && .venv/bin/pip install -q -U pip && .venv/bin/pip install -q -e '.[tpu]'"
fi

if [ -n "${DATA_FROM:-}" ]; then
  DATA_DIR=${DATA_DIR:-corpus}
  echo "copying $DATA_FROM to $DATA_DIR on every worker"
  ssh_all "set -e; if [ ! -f $DATA_DIR/metadata.json ]; then mkdir -p $DATA_DIR &&
    gcloud storage cp -r '$DATA_FROM/*' $DATA_DIR/; fi"
  set -- "--config.data.path=../$DATA_DIR" "$@"  # relative to ~/resformer_jax, where training runs
fi

ARGS=$(printf ' %q' "$@")
# Each worker's exit status is reported with its name, so the one line at the end can say which failed.
set +e
ssh_all "cd resformer_jax && .venv/bin/python -m resformer_jax.main --config=$CONFIG --workdir=$WORKDIR \
  $ARGS 2>&1 | tee -a train_\$(hostname).log; rc=\${PIPESTATUS[0]};
  [ \$rc -ne 0 ] && echo \"worker \$(hostname) exited with \$rc\" >&2; exit \$rc" 2> >(tee /tmp/resformer_tpu_err.$$ >&2)
rc=$?
set -e
if [ $rc -ne 0 ]; then
  first=$(grep -m1 -E '^worker .* exited with' /tmp/resformer_tpu_err.$$ || true)
  # exit status 5: that worker's watchdog found it stalled (its stacks: WORKDIR/watchdog/process_I.txt)
  case "$first" in *"exited with 5") first="$first (stalled: its watchdog fired; stacks in $WORKDIR/watchdog/)" ;; esac
  echo "error: ${first:+$first first; }the other workers were stopped by JAX's coordination service (after" \
    "config.distributed.heartbeat_timeout_s without heartbeats) or by gcloud. Rerun this same command to resume" \
    "from the newest checkpoint in $WORKDIR (logs: train_<hostname>.log on each worker)" >&2
fi
rm -f /tmp/resformer_tpu_err.$$
exit $rc

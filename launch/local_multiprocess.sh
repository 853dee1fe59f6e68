#!/usr/bin/env bash
# Runs N CPU processes of the same training command on this machine (127.0.0.1), as a
# multi-host job would, and waits for all of them. Process 0's output goes to stdout;
# every process's log is in WORKDIR/logs/process_I.log.
#
#   launch/local_multiprocess.sh N CONFIG WORKDIR [--config.x=v ...]
#   DEVICES_PER_PROCESS=2 PORT=12355 launch/local_multiprocess.sh 2 configs/tiny.py runs/mp
set -uo pipefail
if [ $# -lt 3 ]; then
  echo "usage: $0 N CONFIG WORKDIR [--config.field=value ...]" >&2
  exit 2
fi
N=$1; CONFIG=$2; WORKDIR=$3; shift 3
PYTHON=${PYTHON:-python}
DEVICES=${DEVICES_PER_PROCESS:-2}
PORT=${PORT:-$($PYTHON -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
mkdir -p "$WORKDIR/logs"
# Create the logs first: the processes open theirs only once forked, and tail must not start before that.
for ((i = 0; i < N; i++)); do : >"$WORKDIR/logs/process_$i.log"; done
pids=()
cleanup() { for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done; }
trap cleanup TERM INT
for ((i = 0; i < N; i++)); do
  XLA_FLAGS="--xla_force_host_platform_device_count=$DEVICES" JAX_PLATFORMS=cpu \
    $PYTHON -m resformer_jax.main --config="$CONFIG" --workdir="$WORKDIR" \
    --coordinator_address="127.0.0.1:$PORT" --num_processes="$N" --process_id="$i" "$@" \
    >"$WORKDIR/logs/process_$i.log" 2>&1 &
  pids+=($!)
done
tail -n +1 -f "$WORKDIR/logs/process_0.log" --pid="${pids[0]}" &
tailpid=$!
status=0
for ((i = 0; i < N; i++)); do
  wait "${pids[$i]}"; rc=$?
  while [ $rc -gt 128 ] && kill -0 "${pids[$i]}" 2>/dev/null; do wait "${pids[$i]}"; rc=$?; done
  if [ $rc -ne 0 ]; then
    echo "process $i exited with $rc (log: $WORKDIR/logs/process_$i.log)" >&2
    status=$rc
  fi
done
wait $tailpid 2>/dev/null
exit $status

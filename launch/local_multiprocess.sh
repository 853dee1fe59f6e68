#!/usr/bin/env bash
# Runs N CPU processes of the same training command on this machine (127.0.0.1), as a
# multi-host job would, and waits for all of them. Process 0's output goes to stdout;
# every process's log is in WORKDIR/logs/process_I.log.
#
#   launch/local_multiprocess.sh N CONFIG WORKDIR [--config.x=v ...]
#   DEVICES_PER_PROCESS=2 PORT=12355 launch/local_multiprocess.sh 2 configs/tiny.py runs/mp
# Your XLA_FLAGS reach every process, with the device count appended (XLA keeps a flag's last value).
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
: >"$WORKDIR/logs/.launched"  # a stall report older than this is an earlier launch's
pids=()
cleanup() { for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done; }
trap cleanup TERM INT
for ((i = 0; i < N; i++)); do
  XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_force_host_platform_device_count=$DEVICES" JAX_PLATFORMS=cpu \
    $PYTHON -m resformer_jax.main --config="$CONFIG" --workdir="$WORKDIR" \
    --coordinator_address="127.0.0.1:$PORT" --num_processes="$N" --process_id="$i" "$@" \
    >"$WORKDIR/logs/process_$i.log" 2>&1 &
  pids+=($!)
done
tail -n +1 -f "$WORKDIR/logs/process_0.log" --pid="${pids[0]}" &
tailpid=$!
index_of() { for ((j = 0; j < N; j++)); do [ "${pids[$j]}" = "$1" ] && echo $j; done; }
describe() {  # an exit status in words
  if [ "$1" -gt 128 ]; then echo "killed by signal $(($1 - 128)) (SIG$(kill -l $(($1 - 128)) 2>/dev/null || echo '?'))";
  else echo "exit status $1"; fi
}
status=0; first=""; first_rc=0; aborted=0
running=("${pids[@]}")
while [ ${#running[@]} -gt 0 ]; do
  # (wait's stderr: bash's own "Aborted ..." job notice; the line below says it once, in words)
  wait -n -p done_pid "${running[@]}" 2>/dev/null; rc=$?
  [ -z "${done_pid:-}" ] && break
  i=$(index_of "$done_pid")
  running=(${running[@]/$done_pid})
  if [ $rc -ne 0 ]; then
    echo "process $i: $(describe $rc) (log: $WORKDIR/logs/process_$i.log)" >&2
    if [ -z "$first" ]; then first=$i; first_rc=$rc; elif [ $rc -eq 134 ] || [ $rc -eq 4 ]; then aborted=1; fi
    status=$rc
  fi
  unset done_pid
done
wait $tailpid 2>/dev/null
# A stalled process (its watchdog's exit status 5) or one that died (a signal, or the coordination service's abort)
# takes the others with it: say which went first.
if [ -n "$first" ] && [ $first_rc -eq 5 ]; then
  step=$(ls "$WORKDIR/checkpoints" 2>/dev/null | grep -E '^[0-9]+$' | sort -n | tail -1)
  # Several watchdogs may fire: the stalled process is one stuck outside a step (a data read, a save, an
  # evaluation); the others wait inside a step's collectives for it.
  for ((j = 0; j < N; j++)); do
    f="$WORKDIR/watchdog/process_$j.txt"
    if [ "$f" -nt "$WORKDIR/logs/.launched" ] && ! head -1 "$f" | grep -q 'phase=step '; then first=$j; break; fi
  done
  stacks="$WORKDIR/watchdog/process_$first.txt"
  where=$(head -1 "$stacks" 2>/dev/null | sed -n "s/.*phase=\(.*\) step=\([0-9]*\) stalled_s=\([0-9.]*\).*/no progress for \3 s in phase '\1' at step \2/p")
  echo "error: process $first stalled (${where:-its watchdog fired}; every thread's stack in $stacks); the others" \
    "stopped with it. Rerun the same command to resume from ${step:+step $step, }the newest checkpoint in" \
    "$WORKDIR/checkpoints" >&2
elif [ -n "$first" ] && { [ $first_rc -gt 128 ] || [ $aborted -eq 1 ]; }; then
  step=$(ls "$WORKDIR/checkpoints" 2>/dev/null | grep -E '^[0-9]+$' | sort -n | tail -1)
  hb=$(printf '%s\n' "$@" | sed -n 's/^--config.distributed.heartbeat_timeout_s=//p' | tail -1)
  echo "error: process $first died first ($(describe $first_rc)); the others stopped with it (a collective with it" \
    "failed, or JAX's coordination service stopped them after config.distributed.heartbeat_timeout_s=${hb:-100} s)." \
    "Rerun the same command to resume from ${step:+step $step, }the newest checkpoint in $WORKDIR/checkpoints" >&2
fi
exit $status

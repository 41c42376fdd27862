#!/usr/bin/env bash
# `make profile`: flame graphs of the replay benchmark's phases (BENCHMARKS.md, "Where the time
# goes"). One run of benches/replay under `perf record` (call graphs by DWARF unwinding, the
# monotonic clock), the benchmark marking each phase's start and end on stderr
# (TETHER_BENCH_MARK_PHASES); then one SVG per phase from the samples inside its marks:
#   bench-out/flame-publish.svg             publishing the backlog (network, fan-out)
#   bench-out/flame-replay.svg              replaying it (server and client in the process)
#   bench-out/flame-live-draining.svg       live events while another client drains a backlog
#   bench-out/flame-publish-replicated.svg  `--ack replicated` publishes, redundancy 1
# and a text summary of each (`perf report`, top symbols) next to them.
#
# EVENTS sets the backlog (default 1,000,000 × 128 B); PROFILE_HZ the sampling rate (default
# 499 per second and core); TETHER_BENCH_OUT the output folder. Needs perf (the linux-perf
# package, installed when missing) and inferno (cargo install, into the target dir's tools).
set -euo pipefail
cd "$(dirname "$0")/.."

EVENTS=${EVENTS:-1000000}
PROFILE_HZ=${PROFILE_HZ:-499}
OUT=${TETHER_BENCH_OUT:-bench-out}
TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target}
TOOLS="$TARGET_DIR/tools"
SUDO=$( [ "$(id -u)" = 0 ] || echo sudo )

if ! command -v perf >/dev/null 2>&1; then
  echo "installing linux-perf (perf record)"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends linux-perf >/dev/null
fi
if [ ! -x "$TOOLS/bin/inferno-flamegraph" ]; then
  echo "installing inferno (flame graphs) into $TOOLS"
  cargo install --quiet --locked --root "$TOOLS" inferno
fi
if [ "$(cat /proc/sys/kernel/perf_event_paranoid)" -gt 1 ] && [ "$(id -u)" != 0 ]; then
  echo "error: perf needs kernel.perf_event_paranoid <= 1 (sysctl) or root" >&2
  exit 1
fi

bin=$(cargo bench --bench replay --no-run 2>&1 | sed -n 's/.*Executable.*(\(.*\))$/\1/p' | tail -1)
[ -x "$bin" ] || { echo "error: the replay benchmark did not build" >&2; exit 1; }

mkdir -p "$OUT"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "profile: $EVENTS events, $PROFILE_HZ Hz (perf record; a few minutes)"
# Only the phases profiled: one measured replay round, a fifth of the backlog for the
# redundancy phase, no matrix, fan-out, idle or connection phases.
TETHER_BENCH_MARK_PHASES=1 TETHER_BENCH_EVENTS=$EVENTS TETHER_BENCH_ROUNDS=1 \
  TETHER_BENCH_MATRIX_EVENTS=0 TETHER_BENCH_FANOUT=0 TETHER_BENCH_IDLE_QUEUES=0 \
  TETHER_BENCH_CONN_CLIENTS=0 TETHER_BENCH_CLI_EVENTS=0 TETHER_BENCH_OUT="$work/bench-out" \
  perf record -q -F "$PROFILE_HZ" -g --call-graph dwarf,16384 -k CLOCK_MONOTONIC \
  -o "$work/perf.data" -- "$bin" >"$work/bench.out" 2>"$work/bench.err"

for phase in publish replay live-draining publish-replicated; do
  start=$(sed -n "s/^# phase $phase start //p" "$work/bench.err" | head -1)
  end=$(sed -n "s/^# phase $phase end //p" "$work/bench.err" | head -1)
  if [ -z "$start" ] || [ -z "$end" ]; then
    echo "profile: no marks for phase $phase (skipped by the settings?)"
    continue
  fi
  perf script -i "$work/perf.data" --time "$start,$end" 2>/dev/null \
    | "$TOOLS/bin/inferno-collapse-perf" >"$work/$phase.folded"
  "$TOOLS/bin/inferno-flamegraph" --title "tether bench: $phase ($EVENTS events)" \
    <"$work/$phase.folded" >"$OUT/flame-$phase.svg"
  # awk, not head: a reader that stops early would kill perf with SIGPIPE (pipefail).
  perf report -i "$work/perf.data" --time "$start,$end" --no-children --stdio -g none \
    --sort symbol --percent-limit 1 2>/dev/null | awk 'NF && n++ < 60' >"$OUT/flame-$phase.txt"
  echo "profile: $OUT/flame-$phase.svg ($(wc -l <"$work/$phase.folded") stacks, $start..$end s)"
done
grep '=' "$work/bench.out" | grep -v '^#' >"$OUT/profile-figures.txt" || true
echo "profile: the run's figures in $OUT/profile-figures.txt (perf slows the run: not comparable)"

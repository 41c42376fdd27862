#!/usr/bin/env bash
# Starts a local three-node Tether cluster (n1, n2, n3) on loopback, sharing one dev cluster CA.
# Ctrl-C stops all three (their data stays in $CLUSTER_DIR, so a second run resumes).
#   BIN=target/release/tether CLUSTER_DIR=data/cluster CLUSTER_BASE_PORT=7401 scripts/run-cluster.sh
set -euo pipefail
BIN=${BIN:-target/release/tether}
DIR=${CLUSTER_DIR:-data/cluster}
BASE=${CLUSTER_BASE_PORT:-7401}
NODES=(n1 n2 n3)
PEERS=()
for i in 0 1 2; do PEERS+=(--peer "${NODES[$i]}=127.0.0.1:$((BASE + i))"); done

# One cluster CA: made in n1's data directory, copied to the others before their first start.
"$BIN" dev-ca --data-dir "$DIR/n1" >/dev/null
for n in n2 n3; do
  mkdir -p "$DIR/$n/tls"
  [ -f "$DIR/$n/tls/ca.pem" ] || cp "$DIR/n1/tls/ca.pem" "$DIR/n1/tls/ca.key" "$DIR/$n/tls/"
done

pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait' INT TERM EXIT
for i in 0 1 2; do
  n=${NODES[$i]}
  "$BIN" server --data-dir "$DIR/$n" --node-id "$n" --listen "127.0.0.1:$((BASE + i))" \
    --metrics "127.0.0.1:$((BASE + 2000 + i))" "${PEERS[@]}" &
  pids+=($!)
done
echo "cluster CA (trust it with --ca): $DIR/n1/tls/ca.pem"
echo "nodes: n1=127.0.0.1:$BASE n2=127.0.0.1:$((BASE + 1)) n3=127.0.0.1:$((BASE + 2))"
echo "admin: http://127.0.0.1:$((BASE + 2000))/ (n1), :$((BASE + 2001)) (n2), :$((BASE + 2002)) (n3);"
echo "       probes /healthz /readyz, metrics /metrics, API /api/v1/queues (every member's queues)"
echo "try:   $BIN subscribe --server 127.0.0.1:$BASE --ca $DIR/n1/tls/ca.pem --region R --all-keys --durable-id d1"
echo "       $BIN put --server 127.0.0.1:$((BASE + 1)) --ca $DIR/n1/tls/ca.pem --region R --key k --value v"
wait -n  # one node stopping (or failing to start) stops the cluster

#!/usr/bin/env bash
# The host's heartbeat relay under a slow coordinator: WORKERS `cohort-worker train` processes
# on this host share one relay, and a loopback proxy holds every coordinator answer back by
# each DELAY in turn (the requests pass at once). For each delay it prints the beats the
# coordinator judged, the HostHeartbeat calls that carried them, how often a worker gave its
# relay up ("heartbeat relay failed" warnings), and the workers that finished verified.
#
#   bash scripts/slow-coordinator.sh [DELAY_MS ...]     (default: 0 100 200 400)
#
# Environment: COHORT_BIN_DIR (default target/release), WORKERS (4), STEPS (300),
# INTERVAL (500ms), LEASE (3s), KEEP=1 keeps the logs (printed at the end).
# Used for docs/failure-semantics.md, "The coordinators answer slowly".
set -euo pipefail

cd "$(dirname "$0")/.."
BIN=${COHORT_BIN_DIR:-target/release}
WORKERS=${WORKERS:-4}
STEPS=${STEPS:-300}
INTERVAL=${INTERVAL:-500ms}
LEASE=${LEASE:-3s}
DELAYS=("$@")
[ ${#DELAYS[@]} -gt 0 ] || DELAYS=(0 100 200 400)
for b in cohort-coordinator cohort-worker; do
    [ -x "$BIN/$b" ] || { echo "no $BIN/$b: cargo build --release -p cohort-coordinator -p cohort-worker" >&2; exit 2; }
done

WORK=$(mktemp -d /tmp/cohort-slow-coordinator.XXXXXX)
PIDS=()
cleanup() {
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    if [ "${KEEP:-0}" = 1 ]; then echo "logs in $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT

# A pipelined delaying proxy: every chunk from upstream is written DELAY after it arrived, in
# order, however many are in flight.
cat > "$WORK/proxy.py" <<'EOF'
import asyncio, sys
port_file, upstream, delay = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]) / 1000
async def forward(reader, writer, delay):
    loop = asyncio.get_running_loop()
    due = asyncio.Queue()
    async def read():
        while data := await reader.read(65536):
            await due.put((loop.time() + delay, data))
        await due.put(None)
    async def write():
        while (item := await due.get()) is not None:
            await asyncio.sleep(max(0.0, item[0] - loop.time()))
            writer.write(item[1])
            await writer.drain()
    try:
        await asyncio.gather(read(), write())
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()
async def handle(client_reader, client_writer):
    try:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", upstream)
    except OSError:
        client_writer.close()
        return
    await asyncio.gather(forward(client_reader, up_writer, 0), forward(up_reader, client_writer, delay))
async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    with open(port_file + ".tmp", "w") as f:
        f.write(str(server.sockets[0].getsockname()[1]))
    import os; os.rename(port_file + ".tmp", port_file)
    async with server:
        await server.serve_forever()
asyncio.run(main())
EOF

# Waits (at most 20 s) for a file to appear; prints its content.
wait_file() {
    for _ in $(seq 200); do
        [ -s "$1" ] && { cat "$1"; return 0; }
        sleep 0.1
    done
    echo "timed out waiting for $1" >&2
    return 1
}

printf '%-9s %7s %15s %13s %9s\n' delay_ms beats HostHeartbeat relay_given_up verified
for delay in "${DELAYS[@]}"; do
    run="$WORK/d$delay"
    mkdir -p "$run"
    echo "token-slow-coordinator-0123456789abcdef" > "$run/token"
    "$BIN/cohort-coordinator" serve --listen 127.0.0.1:0 --store memory \
        --min-workers "$WORKERS" --max-workers "$WORKERS" \
        --heartbeat-interval "$INTERVAL" --lease-ttl "$LEASE" \
        --metrics 127.0.0.1:0 --token-file "$run/token" > "$run/coordinator.log" 2>&1 &
    PIDS+=($!)
    coordinator=$!
    for _ in $(seq 200); do
        grep -q "cohort-coordinator listening on" "$run/coordinator.log" && \
            grep -q "cohort-coordinator metrics on" "$run/coordinator.log" && break
        sleep 0.1
    done
    port=$(sed -n 's/^cohort-coordinator listening on .*:\([0-9]*\)$/\1/p' "$run/coordinator.log")
    metrics=$(sed -n 's/^cohort-coordinator metrics on \(.*\)$/\1/p' "$run/coordinator.log")
    [ -n "$port" ] && [ -n "$metrics" ] || { echo "the coordinator did not start" >&2; cat "$run/coordinator.log" >&2; exit 1; }
    python3 "$WORK/proxy.py" "$run/proxy-port" "$port" "$delay" &
    PIDS+=($!)
    proxy=$!
    proxy_port=$(wait_file "$run/proxy-port")
    workers=()
    for i in $(seq 0 $((WORKERS - 1))); do
        timeout 120 "$BIN/cohort-worker" train --coordinator "http://127.0.0.1:$proxy_port" \
            --coordinator-wait 10s --job slow --worker-id "w$i" --steps "$STEPS" --size 4K \
            --step-interval 50ms --token-file "$run/token" > "$run/w$i.log" 2>&1 &
        workers+=($!)
    done
    failed=0
    for w in "${workers[@]}"; do wait "$w" || failed=$((failed + 1)); done
    counts=$(python3 -c "import urllib.request,sys; sys.stdout.write(urllib.request.urlopen('http://$metrics/metrics', timeout=10).read().decode())")
    beats=$(echo "$counts" | sed -n 's/^cohort_rpcs_total{method="Heartbeat",code="OK"} \([0-9]*\)$/\1/p')
    calls=$(echo "$counts" | sed -n 's/^cohort_rpcs_total{method="HostHeartbeat",code="OK"} \([0-9]*\)$/\1/p')
    given_up=$(cat "$run"/w*.log | grep -c "heartbeat relay failed" || true)
    verified=$(cat "$run"/w*.log | grep -c "event=summary verified_steps=$STEPS final_step=$STEPS failures=0" || true)
    printf '%-9s %7s %15s %13s %9s\n' "$delay" "${beats:-0}" "${calls:-0}" "$given_up" "$verified/$WORKERS"
    kill "$coordinator" "$proxy" 2>/dev/null || true
    wait "$coordinator" "$proxy" 2>/dev/null || true
    [ "$failed" = 0 ] || { echo "$failed workers failed (logs: $run)" >&2; KEEP=1; exit 1; }
done

# Shell helpers (sourced) to run a kvcd daemon in the background for scripts.
# start_kvcd BINARY CONFIG: starts it, waits for the ready line, sets KVCD_PID,
# KVCD_GRPC, KVCD_METRICS and KVCD_LOG_DIR. stop_kvcd: SIGTERM and wait (returns its status).
start_kvcd() {
  KVCD_LOG_DIR=$(mktemp -d)
  "$1" serve --config "$2" >"$KVCD_LOG_DIR/out" 2>"$KVCD_LOG_DIR/err" &
  KVCD_PID=$!
  for _ in $(seq 1200); do  # the ready line comes once the pools are allocated
    grep -q '^kvcd ready' "$KVCD_LOG_DIR/out" && break
    if ! kill -0 "$KVCD_PID" 2>/dev/null; then
      cat "$KVCD_LOG_DIR/err"; echo "kvcd exited before it was ready" >&2; return 1
    fi
    sleep 0.1
  done
  grep -q '^kvcd ready' "$KVCD_LOG_DIR/out" || { echo "kvcd did not become ready" >&2; return 1; }
  KVCD_GRPC=$(sed -n 's/.*grpc=\([^ ]*\).*/\1/p' "$KVCD_LOG_DIR/out")
  KVCD_METRICS=$(sed -n 's/.*metrics=\([^ ]*\).*/\1/p' "$KVCD_LOG_DIR/out")
}
stop_kvcd() {
  kill -TERM "$KVCD_PID" 2>/dev/null || true
  wait "$KVCD_PID"
}

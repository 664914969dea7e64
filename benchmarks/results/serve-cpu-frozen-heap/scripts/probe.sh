#!/bin/bash
cd /work/main
PORT=18777
.venv/bin/python ${SERVE:-benchmarks/results/serve-cpu-frozen-heap/scripts/gcserve.py} serve --port $PORT --threads 2 --max-queue 1024 --log-level warning --dtype bfloat16 > /tmp/frozen-heap-probe.serve.log 2>&1 &
for i in $(seq 120); do curl -sf localhost:$PORT/health >/dev/null && break; sleep 1; done
.venv/bin/python benchmarks/results/serve-cpu-frozen-heap/scripts/probe.py $PORT 8 | sed 's/^/idle /'
.venv/bin/python benchmarks/results/serve-cpu-frozen-heap/scripts/drive.py http://127.0.0.1:$PORT open ${RATE:-545} 20 > /tmp/frozen-heap-probe.drive.log 2>&1 &
sleep 10
.venv/bin/python benchmarks/results/serve-cpu-frozen-heap/scripts/probe.py $PORT 8 | sed 's/^/loaded /' &
sleep 2; SPID=$(pgrep -f "fastbert.cli serve --port $PORT" | head -1)
for i in 1 2 3; do .venv/bin/py-spy dump --pid $SPID > /tmp/frozen-heap-dump$i.txt 2>&1; sleep 1; done
wait %2 %3 2>/dev/null
grep -E "status|texts" /tmp/frozen-heap-probe.drive.log
pkill -INT -f "serve --port $PORT"; sleep 3

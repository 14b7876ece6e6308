#!/usr/bin/env bash
# Everything a lent GPU machine should run, in one device call (each new machine costs minutes):
#   run(carry=[".device"], command="source .device/device-setup.sh && bash bench/gpu_session.sh")
# Every cuda-marked test (a hang inside the driver is cut by the thread timeout method, which
# dumps every stack), then every benchmark. Outputs land under $OUT (they come back).
set -uo pipefail
out=${OUT:-/tmp/streamlane-gpu}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv > "$out/gpu.txt"
timeout -k 5 240 python3 -m pytest -m cuda -q -p no:cacheprovider -rs --timeout 60 \
    --timeout-method=thread > "$out/cuda-tests.log" 2>&1
echo "cuda tests: exit $?"; tail -5 "$out/cuda-tests.log"
timeout -k 5 60 streamlane demo --device cuda --requests 32 --out /tmp/streamlane-demo \
    > "$out/demo.txt" 2>&1
echo "demo: exit $?"; tar -C /tmp -cf "$out/demo.tar" streamlane-demo 2>/dev/null
timeout -k 5 110 python3 bench/bench_runtime.py --device cuda --out "$out/runtime-cuda.json" \
    > "$out/runtime-cuda.txt" 2>&1
echo "bench_runtime: exit $?"
timeout -k 5 180 python3 bench/bench_sched.py --device cuda --out "$out/sched-cuda.json" \
    > "$out/sched-cuda.txt" 2>&1
echo "bench_sched: exit $?"
tail -c 3000 "$out/sched-cuda.txt"

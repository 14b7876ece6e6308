#!/usr/bin/env bash
# Everything a lent GPU machine should run, in one device call (each new machine costs minutes):
#   run(carry=[".device"], command="source .device/device-setup.sh &&
#       STREAMLANE_COMMIT=<hash> bash bench/gpu_session.sh")
# Every cuda-marked test (a hang inside the driver is cut by the thread timeout method, which
# dumps every stack and ends pytest: the GPU-fault test runs on its own, last, so a hang there
# cannot hide the others), the demo, then bench_runtime, bench_sched, driver_calls and the
# overlap with 32 hardware queues (the probes run on their own). Outputs land under $OUT, named
# without the commit: copy what is kept into bench/results/ as <name>-<commit>. Needs the
# test extras (pytest-timeout, hypothesis) installed on the machine.
# SKIP="tests demo runtime sched calls conn32" leaves parts out.
set -uo pipefail
out=${OUT:-/tmp/streamlane-gpu}
skip=" ${SKIP:-} "
mkdir -p "$out"
fault=tests/test_sched_failure.py::test_a_faulting_kernel_on_the_gpu_breaks_the_scheduler_without_a_hang
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv > "$out/gpu.txt"
[[ $skip == *" tests "* ]] || {
  echo "commit: ${STREAMLANE_COMMIT:-unknown (set STREAMLANE_COMMIT)}, $(date -u +%FT%TZ)"
  timeout -k 5 200 python3 -m pytest -m cuda -q -p no:cacheprovider -rfEs --timeout 60 \
      --timeout-method=thread --deselect "$fault"
  echo "== the GPU-fault test"
  timeout -k 5 90 python3 -m pytest -q -p no:cacheprovider --timeout 80 --timeout-method=thread \
      "$fault"
} > "$out/cuda-tests.log" 2>&1
[[ $skip == *" tests "* ]] || grep -E "passed|failed|== " "$out/cuda-tests.log"
if [[ $skip != *" demo "* ]]; then
  echo "commit: ${STREAMLANE_COMMIT:-unknown (set STREAMLANE_COMMIT)}, $(date -u +%FT%TZ)" \
      > "$out/demo.txt"
  timeout -k 5 90 streamlane demo --device cuda --requests 32 --out /tmp/streamlane-demo \
      >> "$out/demo.txt" 2>&1
  echo "demo: exit $?"; tar -C /tmp -cf "$out/demo.tar" streamlane-demo 2>/dev/null
fi
if [[ $skip != *" runtime "* ]]; then
  timeout -k 5 150 python3 bench/bench_runtime.py --device cuda --out "$out/runtime-cuda.json" \
      > "$out/runtime-cuda.txt" 2>&1
  echo "bench_runtime: exit $?"
fi
if [[ $skip != *" sched "* ]]; then
  timeout -k 5 200 python3 bench/bench_sched.py --device cuda --out "$out/sched-cuda.json" \
      > "$out/sched-cuda.txt" 2>&1
  echo "bench_sched: exit $?"
  tail -c 2500 "$out/sched-cuda.txt"
fi
if [[ $skip != *" calls "* ]]; then
  timeout -k 5 60 python3 bench/driver_calls.py --out "$out/driver-calls-cuda.json" \
      > "$out/driver-calls.txt" 2>&1
  echo "driver_calls: exit $?"; tail -c 1500 "$out/driver-calls.txt"
fi
if [[ $skip != *" conn32 "* ]]; then  # the overlap again with 32 hardware queues instead of 8
  CUDA_DEVICE_MAX_CONNECTIONS=32 timeout -k 5 120 python3 bench/bench_sched.py --device cuda \
      --only overlap --out "$out/sched-overlap-conn32-cuda.json" > "$out/sched-overlap-conn32.txt" 2>&1
  echo "bench_sched overlap, 32 connections: exit $?"
  tail -c 1500 "$out/sched-overlap-conn32.txt"
fi

#!/bin/bash
# Session 21 on the H200, one call after Transformer Engine was installed into /tmp/site (../shared/te):
# notebook 07 re-executed in place, model A's bench (engine vs TE's offload), the GPU tests of the planner
# and of TE with TE installed, then the planner's GPU tests and notebook 07's full-size test without TE.
# Every step writes its log to $OUT as it goes, so a step cut short still leaves what it printed.
set -u
export PYTHONUNBUFFERED=1 OFFLOAD_EXAMPLES_REQUIRE_GPU=1
R=$PWD
{ nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv;
  python3 -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version.split()[0])"; git log -1 --format=%h 2>/dev/null; } > "$OUT/gpu.txt" 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/nb .whl/*.whl || exit 1
step() { local name=$1 limit=$2; shift 2; local t=$SECONDS; echo "== $name"; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "   rc=$? in $((SECONDS - t)) s"; }
TE="/tmp/site:/tmp/nb:$R" NOTE="/tmp/nb:$R"
step nb07 130 env PYTHONPATH=$TE python3 -m offload_examples.instruments.notebooks notebooks/07_planner.ipynb --inplace
cp notebooks/07_planner.ipynb "$OUT/"
step bench 190 env PYTHONPATH=$TE python3 -m offload_examples bench --models A --strategies "no offload" engine \
  transformer_engine --ks 2 4 --layers 20 --out "$OUT/bench" --no-plots
step tests_te 90 env PYTHONPATH=$TE OFFLOAD_EXAMPLES_REQUIRE_TE=1 python3 -m pytest -p no:cacheprovider -q --durations=6 \
  -m gpu tests/test_planner.py tests/test_te_gpu.py
step tests_no_te 80 env PYTHONPATH=$NOTE python3 -m pytest -p no:cacheprovider -q --durations=4 -m gpu \
  tests/test_planner.py tests/test_notebooks.py -k "bare_cuda or 07_planner"
tail -n 3 "$OUT"/*.log

#!/usr/bin/env bash
# One GPU session for the CUDA backend: install the workspace, run the GPU tests, the kernel
# benchmark and the throughput benchmarks. Every stage logs to $OUT/<stage>.log and is bounded by
# its own timeout, so one failing stage still leaves the others' results.
#
#   STAGES=install,kernels-tests,nano,nano-sync,kernel-bench,tests,fixed-hf bash packages/backend-cuda/benchmarks/gpu_session.sh
#
# Stages run in this file's order whatever STAGES lists. Triton caches compiled kernels on disk,
# so nano's init_s is a cold-start figure only without kernels-tests before it (init-spy empties
# the cache itself). For stages in another order, run the script once per group with its own
# OUT (OUT=/tmp/out/first STAGES=install,nano ...; OUT=/tmp/out/then STAGES=init-spy ...).
#
# Needs the wheels in .whl/ on a machine without a package index (9 MB; the versions CI's
# constraints resolved on 2026-12-07, fetched for Python 3.12 by ../shared/tools/device-wheels):
#   hatchling==1.33.0 pathspec==1.1.1 trove-classifiers==2026.9.21.13 editables==0.5 pyzmq==27.3.0
#   msgspec==0.23.0 compressed-tensors==0.20.1 gguf==0.19.0 xgrammar==0.2.9
#   apache-tvm-ffi==0.1.15.post2 loguru==0.8.0
#   pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
# (xgrammar's structural tags import pydantic, which the machine's image lacks: without it
# test_cuda_e2e.py::test_structured_outputs_async_sample_after_forward fails, as on 2026-12-07.)
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/pagedlm-gpu-out}
mkdir -p "$OUT"
STAGES=${STAGES:-install,kernels-tests,nano,kernel-bench,tests,fixed-hf}
has() { [[ ",$STAGES," == *",$1,"* ]]; }
stage() {  # stage NAME TIMEOUT CMD...
  local name=$1 limit=$2; shift 2
  echo "=== $(date +%T) $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "=== $(date +%T) $name rc=$rc in $((SECONDS - t0))s"
  tail -n "${TAIL:-15}" "$OUT/$name.log"
}

summary() {  # summary FILE.json: the numbers a results table needs
  python3 - "$1" <<'PY' || true
import json, sys
r = json.load(open(sys.argv[1]))
keys = ("init_s", "elapsed_s", "output_tokens_per_s", "total_tokens_per_s", "num_steps", "speedup_vs_hf")
print("SUMMARY", sys.argv[1], {k: round(r[k], 3) if isinstance(r.get(k), float) else r.get(k) for k in keys})
if "hf" in r:
    print("SUMMARY hf", {k: v for k, v in r["hf"].items() if not isinstance(v, (dict, list))})
PY
}

if has install; then
  stage install 120 bash -c '
    python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl &&
    python3 -m pip install -q --no-deps --no-build-isolation -e packages/core -e packages/backend-cpu \
      -e packages/backend-cuda -e packages/models-llama -e packages/models-qwen -e packages/models-gemma \
      -e packages/models-llava &&
    python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())" &&
    nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv'
fi
if has kernels-tests; then
  TAIL=25 stage kernels-tests 240 python3 -m pytest -q -n 12 -p no:cacheprovider -rf tests/cuda
fi
BENCH="pagedlm bench throughput --model-config qwen3-0.6b --load-format dummy"
if has nano; then
  stage nano 240 $BENCH --workload nano --output-json "$OUT/nano.json"
  summary "$OUT/nano.json"
fi
if has nano-sync; then  # the same without async scheduling: what overlapping host and device gains
  stage nano-sync 240 $BENCH --workload nano --no-async-scheduling --output-json "$OUT/nano-sync.json"
  summary "$OUT/nano-sync.json"
fi
if has nano-8192; then  # the engine's generic token budget instead of the H200 default (16384)
  stage nano-8192 240 $BENCH --workload nano --max-num-batched-tokens 8192 --output-json "$OUT/nano-8192.json"
  summary "$OUT/nano-8192.json"
fi
if has nano-spy; then  # where the host's time goes (py-spy from .whl/; sampling, so timings hold)
  stage nano-spy 240 py-spy record -r 250 -f raw -o "$OUT/nano-spy.txt" -- \
    python3 -m pagedlm.core.cli bench throughput --model-config qwen3-0.6b --load-format dummy --workload nano
  python3 packages/backend-cuda/benchmarks/spy_summary.py "$OUT/nano-spy.txt" --top 45 >"$OUT/nano-spy-top.txt"
  head -100 "$OUT/nano-spy-top.txt"
fi
if has init-spy; then  # a start-up with Triton's cache empty, under py-spy (--idle: waits count too)
  stage init-spy 240 env TRITON_CACHE_DIR="$(mktemp -d)" \
    py-spy record --idle -r 100 -f raw -o "$OUT/init-spy.txt" -- \
    python3 -m pagedlm.core.cli bench throughput --model-config qwen3-0.6b --load-format dummy --workload nano
  python3 packages/backend-cuda/benchmarks/spy_summary.py "$OUT/init-spy.txt" --within LLM.__init__ --top 60 \
    >"$OUT/init-spy-top.txt"
  head -130 "$OUT/init-spy-top.txt"
fi
if has host; then  # the engine's Python per step on this machine's CPU, model and sampler stubbed out
  stage host 120 python3 packages/backend-cuda/benchmarks/host_overhead.py --async-scheduling
fi
if has ablate; then  # nano with each optimisation switched off in turn (ablate.py), baseline first
  for switch in none torch-sampler request-order two-per-sm; do
    stage "ablate-$switch" 120 python3 packages/backend-cuda/benchmarks/ablate.py "$switch" bench throughput \
      --model-config qwen3-0.6b --load-format dummy --workload nano --output-json "$OUT/ablate-$switch.json"
    summary "$OUT/ablate-$switch.json"
  done
fi
if has nano-greedy; then
  stage nano-greedy 180 $BENCH --workload nano --temperature 0 --output-json "$OUT/nano-greedy.json"
  summary "$OUT/nano-greedy.json"
fi
if has nano-profile; then  # torch.profiler: device busy time against wall time, top kernels
  stage nano-profile 240 $BENCH --workload nano --profile "$OUT/nano-profile" --output-json "$OUT/nano-profile.json"
  head -45 "$OUT/nano-profile/profile-top.txt"
fi
if has kernel-bench; then
  stage kernel-bench 180 python3 packages/backend-cuda/benchmarks/bench_attention.py --output-json "$OUT/kernel.json"
fi
if has kernel-bench-merge; then  # the same with the split-KV partials merged in the attention launch
  stage kernel-bench-merge 180 env PAGEDLM_CUDA_SPLIT_KV_MERGE=kernel \
    python3 packages/backend-cuda/benchmarks/bench_attention.py --output-json "$OUT/kernel-merge.json"
fi
if has quant-bench; then  # the W4A16 GEMV's grid (bulk copies or not), its batch paths; every quantized op
  TAIL=12 stage quant-sweep 180 python3 packages/backend-cuda/benchmarks/bench_quant.py --sweep-mma --rows 1
  TAIL=8 stage quant-batch 120 python3 packages/backend-cuda/benchmarks/bench_quant.py --sweep-batch
  TAIL=40 stage quant-bench 300 python3 packages/backend-cuda/benchmarks/bench_quant.py --rows 1,16,64,256 \
    --output-json "$OUT/quant.json"
fi
if has targets; then  # the open targets (TARGETS=w4a16,fp8,... ; AB=KEY=VALUE adds the A/B of a switch)
  stage targets 540 python3 packages/backend-cuda/benchmarks/gpu_targets.py --out "$OUT/targets" \
    --only "${TARGETS:-w4a16,fp8}" ${AB:+--ab "$AB"}
fi
if has gemma; then  # the real Gemma 3 270M GGUF, carried to /tmp/parts by ../shared/tools/carry-parts' calls
  if ls /tmp/parts/part.* >/dev/null 2>&1; then
    (cd /tmp/parts && cat part.* > gemma-3-270m-q4_k_m.gguf && sha256sum -c SHA256SUM && rm part.*)
  fi
  # a fresh machine compiles every kernel first: 100 s was too little on 2026-12-07
  TAIL=6 stage gemma 240 env PAGEDLM_GEMMA3_GGUF=/tmp/parts/gemma-3-270m-q4_k_m.gguf \
    python3 -m pytest -q -p no:cacheprovider -rf tests/cuda/test_gemma3_270m_cuda.py
fi
if has gemv-bench; then  # the decode GEMV's sweep against cuBLAS (GEMV_ARGS="" for the full sweep)
  stage gemv-bench 540 python3 packages/backend-cuda/benchmarks/bench_dense_gemv.py ${GEMV_ARGS---quick} \
    --output-json "$OUT/gemv.json"
fi
if has fixed-hf; then
  stage fixed-hf 420 $BENCH --workload fixed --num-prompts 256 --input-len 512 --output-len 512 --compare hf \
    --output-json "$OUT/fixed-hf.json"
  summary "$OUT/fixed-hf.json"
fi
if has tests; then
  # -v: with xdist every result is a line as it happens, so a cut-off run still names its failures
  TAIL=40 stage tests ${TESTS_LIMIT:-300} python3 -m pytest -v -n 12 -p no:cacheprovider -rf --timeout=600 \
    ${TESTS:-tests}
  grep -E "FAILED|ERROR" "$OUT/tests.log" | sort -u | head -40
fi
if has fixed; then
  stage fixed 180 $BENCH --workload fixed --num-prompts 256 --input-len 512 --output-len 512 \
    --output-json "$OUT/fixed.json"
  summary "$OUT/fixed.json"
fi
echo "=== $(date +%T) done"

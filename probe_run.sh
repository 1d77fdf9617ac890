set -x
export PYTHONPATH=$PWD GIT_REV=378aba0 JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1
nvidia-smi -L
timeout 100 python3 dispatch_probe.py default 2>&1 | tail -3
XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 100 python3 dispatch_probe.py nocmdbuf 2>&1 | tail -3
S="bench serve --model random-llama-8b --classes mid --sessions 16 --followups 3 --kv-gib 46 --variants tangram"
timeout 210 python3 dispatch_serve.py default $S --json $OUT/serve_default.json > $OUT/serve_default.log 2>&1
grep PROBE $OUT/serve_default.log; tail -5 $OUT/serve_default.log
if python3 -c "import json,sys; d=json.load(open('$OUT/probe_default.json')); n=json.load(open('$OUT/probe_nocmdbuf.json')); sys.exit(0 if d['same_program_other_input']>10*max(n['same_program_other_input'],1) else 1)"; then
  XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 200 python3 dispatch_serve.py nocmdbuf $S --json $OUT/serve_nocmdbuf.json > $OUT/serve_nocmdbuf.log 2>&1
  grep PROBE $OUT/serve_nocmdbuf.log; tail -5 $OUT/serve_nocmdbuf.log
else
  PROBE_PUT=1 timeout 200 python3 dispatch_serve.py put $S --json $OUT/serve_put.json > $OUT/serve_put.log 2>&1
  grep PROBE $OUT/serve_put.log; tail -5 $OUT/serve_put.log
fi

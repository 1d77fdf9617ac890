export PYTHONPATH=$PWD GIT_REV=378aba0 JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1
pip install -q --no-deps .pyspy/*.whl 2>&1 | tail -1; export PROBE_SPY=$(which py-spy); echo spy=$PROBE_SPY
S="bench serve -- --model random-llama-8b --classes mid --sessions 16 --followups 3 --kv-gib 46 --variants tangram"
timeout 230 python3 dispatch_serve.py default $S --json $OUT/serve_default.json > $OUT/serve_default.log 2>&1
grep PROBE $OUT/serve_default.log; tail -4 $OUT/serve_default.log; cat $OUT/spy.log | tail -3
unset PROBE_SPY
PROBE_PUT=1 timeout 200 python3 dispatch_serve.py put $S --json $OUT/serve_put.json > $OUT/serve_put.log 2>&1
grep PROBE $OUT/serve_put.log; tail -4 $OUT/serve_put.log

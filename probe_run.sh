export PYTHONPATH=$PWD GIT_REV=1685ce8 JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1
pip install -q --no-deps .pyspy/*.whl > /dev/null 2>&1; export PROBE_SPY=$(which py-spy)
S="bench serve -- --model random-llama-8b --classes mid --sessions 16 --followups 3 --kv-gib 46 --variants tangram"
timeout 280 python3 dispatch_serve.py tp2 $S --tensor-parallel-size 2 --json $OUT/tp2.json > $OUT/tp2.log 2>&1
grep PROBE $OUT/tp2.log; grep -A2 "^config" $OUT/tp2.log
CUDA_VISIBLE_DEVICES=0 timeout 250 python3 dispatch_serve.py tp1 $S --json $OUT/tp1.json > $OUT/tp1.log 2>&1
grep PROBE $OUT/tp1.log; grep -A2 "^config" $OUT/tp1.log
rm -f $OUT/*.png; ls -la $OUT

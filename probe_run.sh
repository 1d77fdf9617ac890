export PYTHONPATH=$PWD GIT_REV=1685ce8 JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1
nvidia-smi -L
timeout 90 python3 dispatch_probe.py default 2>&1 | tail -1
timeout 540 bash benchmarks/serve_per_gpu.sh $OUT/mid.json tangram,tangram@tp2 --model random-llama-8b --classes mid --sessions 16 --followups 3 --kv-gib 46 > $OUT/mid.log 2>&1
rm -f $OUT/mid.parts/*.png $OUT/mid.png; tail -8 $OUT/mid.log
python3 -c "
import json; d=json.load(open('$OUT/mid.json'))
for r in d['results']:
    w=r['workloads'][0]; print(r['variant'], round(w['turns_per_s'],3), round(w['seconds'],1), w.get('step_loop_shares'))
"

export PYTHONPATH=$PWD GIT_REV=26314fd JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1
timeout 560 bash benchmarks/serve_per_gpu.sh $OUT/serve_gpu_tp_mid.json tangram,tangram@tp2 --model random-llama-8b --classes mid --sessions 16 --followups 3 --kv-gib 46 > $OUT/mid.log 2>&1
tail -6 $OUT/mid.log
python3 -c "
import json; d=json.load(open('$OUT/serve_gpu_tp_mid.json'))
for r in d['results']:
    w=r['workloads'][0]; print(r['variant'], round(w['turns_per_s'],3), round(w['seconds'],1), w.get('step_loop_shares'))
"

#!/usr/bin/env bash
# The embedded model on the device machine, sourced by the accuracy and kvpress GPU scripts.
# The GGUF (94 MB) is larger than one device call may carry (64 MiB with the tree), so it
# travels in two pieces over two calls on the same warm machine: a carried path not named in a
# later call is removed there, but /tmp stays. Each call stages the pieces it carries in
# /tmp/gguf-parts; once both are there they are joined and checked against the file's md5
# (a join of the wrong pieces is refused, not served).
#   call 1: carry .gpu/model/smollm2.gguf.part00      MODEL_PARTS=.gpu/model bash benchmarks/gpu_model.sh
#   call 2: carry .gpu/model/smollm2.gguf.part01 ...  (the run script sources this file)
# Also makes `gguf` (wheel in $WHEELS) and `needlehaystack` (package folder in $NEEDLE_PKGS)
# importable: the GPU image has neither.
MODEL_PARTS=${MODEL_PARTS:-.gpu/model}; WHEELS=${WHEELS:-.gpu/acc-wheels}
NEEDLE_PKGS=${NEEDLE_PKGS:-.gpu/acc-pkgs}
GGUF_MD5=a1231443440b107ff29f02bdb38c9d0a
GGUF=/tmp/smollm2.gguf
mkdir -p /tmp/gguf-parts
cp -n "$MODEL_PARTS"/smollm2.gguf.part* /tmp/gguf-parts/ 2>/dev/null
if [ "$(md5sum "$GGUF" 2>/dev/null | cut -d' ' -f1)" != "$GGUF_MD5" ]; then
  cat /tmp/gguf-parts/smollm2.gguf.part* > "$GGUF.$$" && mv "$GGUF.$$" "$GGUF"
  if [ "$(md5sum "$GGUF" | cut -d' ' -f1)" != "$GGUF_MD5" ]; then
    echo "the GGUF pieces in /tmp/gguf-parts ($(ls /tmp/gguf-parts | tr '\n' ' ')) do not join to" \
         "the model (md5 $GGUF_MD5): carry the missing piece (see benchmarks/gpu_model.sh)" >&2
    rm -f "$GGUF"
    return 1 2>/dev/null || exit 1
  fi
fi
if ! python3 -c "import gguf" 2>/dev/null; then
  [ -d /tmp/site/gguf ] || python3 -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --target /tmp/site --upgrade "$WHEELS"/*.whl || { return 1 2>/dev/null || exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
[ -d "$NEEDLE_PKGS" ] && export PYTHONPATH=$(cd "$NEEDLE_PKGS" && pwd)${PYTHONPATH:+:$PYTHONPATH}
echo "model: $GGUF (md5 ok)"

#!/usr/bin/env bash
# The prepared device check: one call on a lent GPU (one H100 or H200), under 8 minutes, leaving what it
# measured in $OUT (8 files at most). Each part has its own time limit, so one slow part cannot starve the rest,
# and each writes as it goes (the accelerator report is saved part by part).
#   1. `bench accelerator`: attention kernels (correctness, speed), auto's choice, the 468M train step as shipped
#      per attention impl, the decode engine's matrix
#   2. the 468M train step as shipped (cudnn, 16 sequences a GPU), vanilla/ResFormer/SVFormer/SkipV1 taking turns
#   3. the decode engine, 468M, batch 16 and 128 at 2,048 tokens of context, vanilla and SVFormer (1 and 64 are
#      part 1's; each batch and variant is an engine of its own, its decode step compiled afresh: 10-20 s each)
#   4. the decode engine, 468M SVFormer, batch 64 with every request sampled (temperature 0.8, top-p 0.9)
#   5. the shared-prefix workload through the engine, 468M vanilla and SVFormer at one cache budget (16 prefixes of
#      512 tokens, 64 requests): the prefix cache's hit rate, the prompt tokens computed, TTFT, sequences held
#   6. attention forward+backward at head_dim 64 and 128 (GQA at 128)
# Packages the device's image lacks travel as wheels in .whl/ (see docs/device/README.md).
set -u
OUT=${OUT:-/tmp/accelerator_check}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
B="python3 -m resformer_jax bench"
SHIPPED="--config=configs/resformer_468m.py --config.mesh.data=-1 --config.mesh.fsdp=1 --config.train.global_batch=16
 --config.train.microbatch=0"
{
  date
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.memory --format=csv
  nproc
  python3 -c "import jax, jaxlib, flax, optax, numpy; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, \
'flax', flax.__version__, 'optax', optax.__version__, 'numpy', numpy.__version__); print(jax.devices())"
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
step() {  # step SECONDS NAME COMMAND...: stdout to NAME.jsonl, stderr to NAME_log.txt, a one-line result here
  local limit=$1 name=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.jsonl" 2>"$OUT/${name}_log.txt"
  echo "== $name: rc $? in $((SECONDS - t0)) s"
}
step "${T_ACCEL:-210}" accelerator $B accelerator --out="$OUT/accelerator_report.json"
grep -vE "^(W|I)[0-9]{4} " "$OUT/accelerator_log.txt" | tail -25
step "${T_VARIANTS:-85}" train_variants $B train $SHIPPED --config.model.attention_impl=cudnn --steps=3 \
  --compare=none,resformer,svformer,skipv1
tail -6 "$OUT/train_variants_log.txt"
step "${T_DECODE:-85}" decode $B decode --config=configs/resformer_468m.py --compare=none,svformer \
  --matrix=16,128:2048 --new_tokens=16 --rounds=1 --prefill=false
tail -10 "$OUT/decode_log.txt"
t0=$SECONDS  # the same files again (8 come back at most): SVFormer at batch 64 with every request sampled
timeout "${T_SAMPLED:-30}" $B decode --config=configs/resformer_468m.py --compare=svformer --matrix=64:2048 \
  --new_tokens=16 --rounds=1 --prefill=false --temperature=0.8 --top_p=0.9 >>"$OUT/decode.jsonl" 2>>"$OUT/decode_log.txt"
echo "== decode sampled: rc $? in $((SECONDS - t0)) s"
tail -3 "$OUT/decode_log.txt"
t0=$SECONDS  # the shared-prefix workload, into the decode files too
timeout "${T_PREFIX:-45}" $B decode --config=configs/svformer_468m.py --compare=none,svformer --stream=64 \
  --shared_prefixes=16 --prefix_len=512 --context=64 --new_tokens=16 --cache_gib=2 \
  >>"$OUT/decode.jsonl" 2>>"$OUT/decode_log.txt"
echo "== decode shared prefixes: rc $? in $((SECONDS - t0)) s"
tail -2 "$OUT/decode.jsonl"
t0=$SECONDS  # stdout and stderr in one file: 8 files come back at most
timeout "${T_ATTN:-25}" $B attention --shapes=4,2048,16,16,64 --shapes=4,2048,16,4,128 --impls=pallas,cudnn,xla \
  --dtype=bfloat16 >"$OUT/attention.txt" 2>&1
echo "== attention: rc $? in $((SECONDS - t0)) s"
grep -vE "^(W|I)[0-9]{4} " "$OUT/attention.txt" | tail -8
rm -f "$OUT/accelerator.jsonl"  # the report's copy on stdout; accelerator_report.json holds it

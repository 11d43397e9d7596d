#!/usr/bin/env bash
# Tensor parallelism on this machine, one run: `moat generate` on the bench checkpoint at TP 1 (one
# and two threads) and under `mpirun -np 2` at TP 2 (one thread per rank; experts split inside
# each expert, then by expert with --ep), greedy, the same prompt and 32 new tokens. Prints a
# markdown section: prefill and decode tok/s, peak RSS per rank against the checkpoint, the bytes
# each rank contributes to collectives per decode token (model and measured) and the time spent in
# them; then the model of the same cost for Kimi K3 at TP 8 on each GPU's NVLink / Infinity Fabric
# (data/hardware.json) next to `moat plan`'s per-stream decode estimate, which leaves it out.
#   bench/tp_bench.sh     (BUILD_DIR=build, MODEL=checkpoints/bench-serve: the bench checkpoint with a
#                          tokenizer linked beside it, as bench/serve_bench.sh makes it)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
MODEL=${MODEL:-checkpoints/bench-serve}
ALLREDUCE_LATENCY_US=${ALLREDUCE_LATENCY_US:-10}
moat=$BUILD_DIR/moat
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
if [[ ! -f "$MODEL/tokenizer.json" ]]; then
  echo "no $MODEL with a tokenizer: run bench/serve_bench.sh once (it links one beside checkpoints/bench)" >&2
  exit 1
fi
prompt=$(head -c 1200 docs/architecture.md | tr '\n' ' ')
args=(generate --model "$MODEL" --prompt "$prompt" --max-tokens 32 --ignore-eos --temperature 0 --max-context 1024)
run() {  # label, then the command; prints one JSON object
  local label=$1; shift
  local err
  err=$("$@" 2>&1 >/dev/null)
  /usr/bin/python3 - "$label" "$err" <<'PY'
import json, re, sys
label, err = sys.argv[1], sys.argv[2]
m = re.search(r"prompt (\d+) tokens, prefill ([\d.]+) tok/s .*generated (\d+) tokens .*decode ([\d.]+) tok/s; (\d+) threads.*peak RSS ([\d.]+) MiB", err)
if not m:
    sys.exit(f"{label}: no summary in:\n{err}")
row = dict(label=label, prompt=int(m[1]), prefill=float(m[2]), generated=int(m[3]), decode=float(m[4]),
           threads=int(m[5]), rss=[float(m[6])])
c = re.search(r"rank 0 made (\d+) collectives, ([\d.]+) MB, ([\d.]+) s in them \(([\d.]+)% of the run\)", err)
row["coll_mb"], row["coll_s"], row["coll_pct"] = (float(c[2]), float(c[3]), float(c[4])) if c else (0, 0, 0)
for w in re.finditer(r"tp rank (\d+) of \d+: peak RSS ([\d.]+) MiB", err):
    row["rss"].append(float(w[2]))
print(json.dumps(row))
PY
}
rows=$(
  run "TP 1, 1 thread" "$moat" "${args[@]}" --threads 1
  run "TP 1, 2 threads" "$moat" "${args[@]}" --threads 2
  run "TP 2 x 1 thread" mpirun --oversubscribe -np 2 "$moat" "${args[@]}" --threads 1 --tp 2
  run "TP 2 x 1 thread, --ep" mpirun --oversubscribe -np 2 "$moat" "${args[@]}" --threads 1 --tp 2 --ep
)
"$moat" plan --model kimi-k3 --context 1M --all --json > /tmp/moat-tp-plan.$$.json
/usr/bin/python3 - "$MODEL" "$rows" /tmp/moat-tp-plan.$$.json "$ALLREDUCE_LATENCY_US" <<'PY'
import json, os, sys
model, rows, plan_file, latency_us = sys.argv[1], [json.loads(l) for l in sys.argv[2].splitlines()], sys.argv[3], float(sys.argv[4])
cfg = json.load(open(os.path.join(model, "config.json")))
H, L, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
ckpt_mib = sum(os.path.getsize(os.path.join(model, f)) for f in os.listdir(model) if f.endswith(".safetensors")) / 2**20
print(f"bench/tp_bench.sh: `moat generate` on {model} (DeepSeek-V2-Lite shapes, {L} layers, bf16, {ckpt_mib:,.0f} MiB of "
      f"safetensors), a {rows[0]['prompt']}-token prompt, {rows[0]['generated']} greedy tokens; TP 2 under `mpirun -np 2`, "
      "one thread per rank, so TP 2 and TP 1 x 2 threads use the same two cores. Collectives per decode token (model): "
      f"2 all-reduces per layer of hidden x fp32 ({2 * L} x {H} x 4 B = {2 * L * H * 4:,} B) and the vocabulary-parallel "
      f"lm_head's logits gathered ({V} / 2 x 4 B = {V * 2:,} B contributed per rank); measured: rank 0's own count over "
      "the whole run (prefill included) over the tokens generated.")
print()
print("| setup | prefill tok/s | decode tok/s | decode vs TP 1 x 2 threads | peak RSS per rank MiB | RSS / checkpoint | "
      "collective B / token (model) | collective MB (measured, whole run) | time in collectives |")
print("|---|---|---|---|---|---|---|---|---|")
base = next(r for r in rows if r["label"] == "TP 1, 2 threads")["decode"]
for r in rows:
    tp = len(r["rss"])
    model_b = f"{(2 * L * H * 4 + V // tp * 4):,}" if tp > 1 else "-"
    rss = " / ".join(f"{x:,.0f}" for x in r["rss"])
    ratio = " / ".join(f"{x / ckpt_mib:.2f}" for x in r["rss"])
    coll = f"{r['coll_mb']:.2f}" if tp > 1 else "-"
    pct = f"{r['coll_s']:.3f} s ({r['coll_pct']:.0f}%)" if tp > 1 else "-"
    print(f"| {r['label']} | {r['prefill']:.1f} | {r['decode']:.2f} | {r['decode'] / base:.2f} | {rss} | {ratio} | {model_b} | {coll} | {pct} |")
print()
hw = {g["id"]: g for g in json.load(open("data/hardware.json"))["gpus"]}
plan = [p for p in json.load(open(plan_file)) if p.get("tp") == 8 and p.get("fits")]
models = json.load(open("data/models.json"))
k3 = next(m for m in (models["models"] if isinstance(models, dict) else models) if m["id"] == "kimi-k3")
tc = k3["config"].get("text_config", k3["config"])
KH, KL = tc["hidden_size"], tc["num_hidden_layers"]
n = 8
per_call = KH * 2 * 2 * (n - 1) / n  # bf16, ring all-reduce: 2 (N-1)/N of the payload through each link
calls = 2 * KL
print(f"Kimi K3 at TP 8, the same structure on GPUs: {calls} all-reduces per decode token ({KL} layers x 2: after attention, "
      f"MLA or KDA, and after the MoE), each {KH} x bf16 = {KH * 2:,} B, of which a ring moves 2 (N-1)/N = "
      f"{per_call:,.0f} B through each GPU's link; the logits gather adds vocab x 4 B once per token. Time per token = "
      f"{calls} x {latency_us:.0f} us (an assumed small-message all-reduce latency, ALLREDUCE_LATENCY_US) + bytes / "
      "link bandwidth. `moat plan`'s tok/s/strm (the bandwidth roofline at 0.6 efficiency, 1M context) leaves "
      "communication out; the last column puts it in.")
print()
print("| GPU | link GB/s (one direction) | B / token through the link | bandwidth us / token | latency us / token | plan tok/s/strm | plan ms / token | with all-reduces tok/s | share of the step |")
print("|---|---|---|---|---|---|---|---|---|")
vocab = tc.get("vocab_size", 163840)
for p in plan:
    g = hw.get(p["hardware"])
    if not g or not p.get("decode_tps_per_stream_est"):
        continue
    link = g["intra_node_gbps"]
    b = calls * per_call + vocab * 4
    bw_us = b / (link * 1e9) * 1e6
    lat_us = calls * latency_us
    step_ms = 1e3 / p["decode_tps_per_stream_est"]
    total_ms = step_ms + (bw_us + lat_us) / 1e3
    print(f"| {g['name']} | {link} | {b:,.0f} | {bw_us:.1f} | {lat_us:.0f} | {p['decode_tps_per_stream_est']:.1f} | {step_ms:.2f} | "
          f"{1e3 / total_ms:.1f} | {(bw_us + lat_us) / 1e3 / total_ms:.0%} |")
PY
rm -f /tmp/moat-tp-plan.$$.json

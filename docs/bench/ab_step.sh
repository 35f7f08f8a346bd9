#!/usr/bin/env bash
# Times one training-step configuration on several builds of cohort alternately, in the same
# minutes (this VM's speed drifts by ±5% over an hour, so only alternated figures compare), and
# prints each run's step time, MFU and the product/attention/LayerNorm times. Run it with nothing
# else running:
#   bash docs/bench/ab_step.sh CONFIG THREADS PRECISION ROUNDS OLD_BIN NEW_BIN...
#   bash docs/bench/ab_step.sh B 2 bf16 3 /tmp/cohort-before target/release/cohort
set -u
cfg=${1:?usage: ab_step.sh CONFIG THREADS PRECISION ROUNDS BIN...}
th=${2:?threads}; prec=${3:?precision}; rounds=${4:?rounds}; shift 4
steps=6; warm=2
[ "$cfg" = G ] && { steps=3; warm=1; }
for _ in $(seq "$rounds"); do
  for bin in "$@"; do
    "$bin" bench train --config "$cfg" --threads "$th" --steps $steps --warmup $warm \
      --precision "$prec" --json 2>/dev/null | tail -1 | BIN="$bin" python3 -c '
import json, os, sys
d = json.loads(sys.stdin.read()); k = dict(d["kernels_ms"])
pair = lambda name: k[name + "_fwd"] + k[name + "_bwd"]
print("%s: %s %st %s: step %.1f ms, MFU %.3f, products %.1f, attention %.1f, layernorm %.1f ms" % (
    os.environ["BIN"], d["config"], d["threads"], d["precision"], d["ms_per_step"], d["mfu"],
    pair("matmul"), pair("attention"), pair("layernorm")))'
  done
done

#!/usr/bin/env bash
# Two "nodes" on one machine, joined by a shaped link: cohort DDP, cohort ZeRO-2, cohort DiLoCo
# (synchronous and overlapped) and PyTorch's gloo DDP side by side, one rank per node, and the
# table of issue 41 (docs/guides/slow-links.md).
#
# Each node is a network namespace with its own IP; a veth pair joins them, and HTB on both
# ends caps the link at each --rates value (netem adds --delay, one way, on both ends). For
# every rate: cohort DDP and DiLoCo (`cohort run --nnodes 2 --node-rank R --master-addr
# <node 0>`, rank 0 on node 0) and PyTorch DDP (`torchrun --nnodes 2`, docs/bench/bench_ddp.py).
# Efficiency is tokens/s over 2x a single rank's, measured in node 0 first (the same script,
# one process); beside it, over two independent ranks run at once (one per node, no
# communication: what this shared machine allows two ranks at all). Every rank runs one thread (COHORT_NUM_THREADS / OMP_NUM_THREADS = 1).
# DDP's row says what its gradients travelled in (chosen by the link, as the header says why);
# where that was bf16, a second row forces fp32 to show what it saved. ZeRO-2's row says the same,
# and whether its overlap is on (as its header says).
# Exposed comm is what rank 0 waited for communication per step: DDP's and ZeRO-2's comm phase;
# DiLoCo's outer all-reduce over H steps (overlapped: what the syncs waited for it). Both
# "nodes" share this machine's cores.
#
#   sudo scripts/two-node-bench.sh                           # 1 and 10 Gbit/s, config B
#   sudo scripts/two-node-bench.sh --rates 1gbit --delay 1ms --steps 100 --sync-every 50
#   sudo scripts/two-node-bench.sh --quick                   # a functional run: tiny, 2 steps
#   sudo scripts/two-node-bench.sh --only zero2,ddp          # a subset of the systems
#
# --only takes a comma list of ddp (with its fp32 row where DDP chose bf16), zero2, diloco,
# diloco-overlap and torch (default: all); the single-rank and independent-ranks baselines
# always run.
#
# Needs root, `ip` and `tc` (iproute2), and a built cohort (--cohort, default
# target/release/cohort); the PyTorch rows need python3 with torch (skipped without it). Exits
# 2, saying why, where namespaces cannot be made. The namespaces are deleted on any exit.
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
cohort=${COHORT_BIN:-$here/target/release/cohort}
rates="1gbit 10gbit"
delay=""
steps=60
sync_every=50
quick=0
torch=1
all_systems="ddp zero2 diloco diloco-overlap torch"
only=$all_systems
while [ $# -gt 0 ]; do
  case "$1" in
    --cohort) cohort=$2; shift 2 ;;
    --rates) rates=$2; shift 2 ;;
    --delay) delay=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --sync-every) sync_every=$2; shift 2 ;;
    --quick) quick=1; shift ;;
    --no-torch) torch=0; shift ;;
    --only) only=${2//,/ }; shift 2 ;;
    -h|--help) sed -n '/^set -euo/q;2,$p' "$0"; exit 0 ;;
    *) echo "two-node-bench: unknown argument $1 (see --help)" >&2; exit 1 ;;
  esac
done

for system in $only; do
  case " $all_systems " in
    *" $system "*) ;;
    *) echo "two-node-bench: --only: unknown system $system (one of: ${all_systems// /, })" >&2; exit 1 ;;
  esac
done
[ -n "$only" ] || { echo "two-node-bench: --only names no system (one of: ${all_systems// /, })" >&2; exit 1; }
# Whether --only selected a system.
selected() { case " $only " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
selected torch || torch=0

# Config B (docs/PERFORMANCE.md), or a tiny model for --quick.
if [ "$quick" = 1 ]; then
  steps=2; sync_every=1; rates=${rates%% *}
  shape=(--n-layers 2 --n-heads 2 --d-model 32 --d-ff 64 --seq-len 16 --batch-size 2
         --vocab-size 65)
  torch_config=A; torch_steps=2
else
  shape=(--n-layers 6 --n-heads 6 --d-model 384 --d-ff 1536 --seq-len 256 --batch-size 8
         --vocab-size 65)
  torch_config=B; torch_steps=$steps
fi
train=(train --data random --train-sequences 20000 --val-sequences 16 --eval-batches 1
       --eval-interval 0 --log-interval 1000000 --steps "$steps" --warmup-steps 1 "${shape[@]}")

[ -x "$cohort" ] || { echo "two-node-bench: no cohort binary at $cohort (cargo build --release, or --cohort BIN)" >&2; exit 1; }
[ "$(id -u)" = 0 ] || { echo "two-node-bench: skipped: needs root for ip netns" >&2; exit 2; }
command -v ip >/dev/null && command -v tc >/dev/null \
  || { echo "two-node-bench: skipped: needs ip and tc (iproute2)" >&2; exit 2; }
if [ "$torch" = 1 ] && ! python3 -c "import torch" 2>/dev/null; then
  echo "two-node-bench: python3 has no torch: the PyTorch rows are skipped" >&2; torch=0
fi

tag=$(( $$ % 100000 ))
ns=(cohortbench-$tag-0 cohortbench-$tag-1)
veth=(cb${tag}a cb${tag}b)
subnet="10.$(( 150 + $$ % 50 )).$(( $$ % 250 ))"
ips=("$subnet.1" "$subnet.2")
work=$(mktemp -d)
cleanup() {
  for n in "${ns[@]}"; do ip netns del "$n" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
trap 'echo "two-node-bench: interrupted" >&2; for f in "$work"/torch*.log; do tail -n 8 "$f" >&2; done; exit 130' INT TERM

for n in "${ns[@]}"; do
  ip netns add "$n" || { echo "two-node-bench: skipped: ip netns add failed" >&2; exit 2; }
done
ip link add "${veth[0]}" type veth peer name "${veth[1]}"
for i in 0 1; do
  ip link set "${veth[$i]}" netns "${ns[$i]}"
  ip -n "${ns[$i]}" addr add "${ips[$i]}/24" dev "${veth[$i]}"
  ip -n "${ns[$i]}" link set "${veth[$i]}" up
  ip -n "${ns[$i]}" link set lo up
done

echo "nodes: ${ns[*]} at ${ips[*]}" >&2

# HTB at `rate` on both ends (and netem's delay under it, when asked).
shape_link() {
  local rate=$1 i
  for i in 0 1; do
    tc -n "${ns[$i]}" qdisc del dev "${veth[$i]}" root 2>/dev/null || true
    tc -n "${ns[$i]}" qdisc add dev "${veth[$i]}" root handle 1: htb default 10 || return 1
    tc -n "${ns[$i]}" class add dev "${veth[$i]}" parent 1: classid 1:10 htb \
      rate "$rate" ceil "$rate" || return 1
    if [ -n "$delay" ]; then
      tc -n "${ns[$i]}" qdisc add dev "${veth[$i]}" parent 1:10 handle 10: netem delay "$delay" \
        || return 1
    fi
  done
}

port=$(( 29000 + $$ % 1000 ))
# `cohort run` on both nodes, one rank each; rank 0's log is the output.
cohort_two_nodes() {
  port=$(( port + 1 ))
  local i
  for i in 1 0; do
    COHORT_SECRET=${COHORT_SECRET:-5ec12e75ec12e75ec12e75ec12e75ec12e75ec12e75ec12e75ec12e75ec12e7b} OMP_NUM_THREADS=1 \
      COHORT_NUM_THREADS=1 ip netns exec "${ns[$i]}" "$cohort" run --nnodes 2 --node-rank "$i" \
      --master-addr "${ips[0]}" --master-port "$port" --join-timeout 60 -n 1 \
      "${train[@]}" "$@" >"$work/node$i.log" 2>&1 &
  done
  wait || true
  cat "$work/node0.log"
}

torch_two_nodes() {
  port=$(( port + 1 ))
  local i
  for i in 1 0; do
    # gloo picks its interface from the hostname, which names no address inside a namespace
    (cd "$here/docs/bench" && OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME="${veth[$i]}" ip netns exec "${ns[$i]}" \
      setsid python3 -m torch.distributed.run --nnodes 2 --node-rank "$i" --nproc-per-node 1 \
      --master-addr "${ips[0]}" --master-port "$port" \
      bench_ddp.py --config "$torch_config" --steps "$torch_steps" --warmup 1 \
      >"$work/torch$i.log" 2>&1) &
  done
  wait || true
  grep '^{' "$work/torch0.log" | tail -1 || true
}

# Figures from a cohort log: tokens/s, the comm phase (ms/step), DiLoCo's ms per outer sync.
tok_s() { sed -n 's/.*done: .* \([0-9]*\) tokens\/s on .*/\1/p' | tail -1; }
comm_ms() { sed -n 's/.*time per step (rank 0): .* comm \([0-9.]*\) .*/\1/p' | tail -1; }
sync_ms() { sed -n 's/.*outer syncs (rank 0): [0-9]*, \([0-9.]*\) ms each.*/\1/p' | tail -1; }
# bf16 or fp32: what DDP's gradients travelled in (the header says, and why).
grads() { sed -n 's/.*gradients: \(bf16\|fp32\) .*/\1/p' | tail -1; }
# on or off: ZeRO's overlap as its header line says it.
zero_overlap() { sed -n 's/.*ZeRO-[23]: .*; overlap \(on\|off\).*/\1/p' | tail -1; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0 && a != "") printf "%.2f", a / b; else print "-" }'; }

echo "single rank (node 0, no link):" >&2
single=$(COHORT_NUM_THREADS=1 OMP_NUM_THREADS=1 ip netns exec "${ns[0]}" "$cohort" "${train[@]}" 2>&1 | tok_s)
torch_single=""
if [ "$torch" = 1 ]; then
  torch_single=$(cd "$here/docs/bench" && OMP_NUM_THREADS=1 ip netns exec "${ns[0]}" \
    setsid python3 -m torch.distributed.run --standalone --nproc-per-node 1 bench_ddp.py \
    --config "$torch_config" --steps "$torch_steps" --warmup 1 2>/dev/null | grep '^{' | tail -1 |
    python3 -c 'import json,sys; print(round(json.load(sys.stdin)["tokens_per_s_total"]))')
fi
echo "  cohort $single tokens/s${torch_single:+, PyTorch $torch_single tokens/s}" >&2
# The same single-rank run in both nodes at once, sharing nothing but this machine: what two
# ranks that never communicate make here. On two real machines this equals 2x a single rank;
# where both "nodes" share one machine's cores and memory it is lower, and a job's efficiency
# against it is what the link and the algorithm cost.
echo "two independent ranks at once (one per node, no communication):" >&2
for i in 0 1; do
  COHORT_NUM_THREADS=1 OMP_NUM_THREADS=1 ip netns exec "${ns[$i]}" "$cohort" "${train[@]}" \
    >"$work/solo$i.log" 2>&1 &
done
wait || true
s0=$(tok_s <"$work/solo0.log"); s1=$(tok_s <"$work/solo1.log")
pair=$(( ${s0:-0} + ${s1:-0} ))
echo "  cohort $pair tokens/s ($(ratio "$pair" $(( 2 * single ))) of 2x a single rank)" >&2

rows=()
for rate in $rates; do
  shape_link "$rate" || { echo "two-node-bench: skipped: tc cannot shape the link (no HTB or netem in this kernel?)" >&2; exit 2; }
  link="$rate${delay:+ +$delay}"
  if selected ddp; then
    echo "link $link: cohort DDP" >&2
    log=$(cohort_two_nodes --strategy ddp --overlap on)
    t=$(tok_s <<<"$log"); c=$(comm_ms <<<"$log"); g=$(grads <<<"$log")
    [ -n "$t" ] || { echo "$log" >&2; echo "two-node-bench: cohort DDP failed" >&2; exit 1; }
    rows+=("| $link | cohort DDP, overlap on, ${g:-?} gradients (auto) | $t | $(ratio "$t" $(( 2 * single ))) | $(ratio "$t" "$pair") | ${c:-?} ms |")
    if [ "$g" = bf16 ]; then
      # What the automatic choice saved: the same run in fp32.
      echo "link $link: cohort DDP, fp32" >&2
      log=$(cohort_two_nodes --strategy ddp --overlap on --bf16-compress false)
      t=$(tok_s <<<"$log"); c=$(comm_ms <<<"$log")
      [ -n "$t" ] || { echo "$log" >&2; echo "two-node-bench: cohort DDP fp32 failed" >&2; exit 1; }
      rows+=("| $link | cohort DDP, overlap on, fp32 gradients | $t | $(ratio "$t" $(( 2 * single ))) | $(ratio "$t" "$pair") | ${c:-?} ms |")
    fi
  fi
  if selected zero2; then
    echo "link $link: cohort ZeRO-2" >&2
    log=$(cohort_two_nodes --strategy zero2 --overlap on)
    t=$(tok_s <<<"$log"); c=$(comm_ms <<<"$log"); g=$(grads <<<"$log"); o=$(zero_overlap <<<"$log")
    [ -n "$t" ] || { echo "$log" >&2; echo "two-node-bench: cohort ZeRO-2 failed" >&2; exit 1; }
    rows+=("| $link | cohort ZeRO-2, overlap ${o:-?}, ${g:-?} gradients (auto) | $t | $(ratio "$t" $(( 2 * single ))) | $(ratio "$t" "$pair") | ${c:-?} ms |")
  fi
  if selected diloco; then
    echo "link $link: cohort DiLoCo H=$sync_every" >&2
    log=$(cohort_two_nodes --strategy diloco --sync-every "$sync_every")
    t=$(tok_s <<<"$log"); s=$(sync_ms <<<"$log")
    [ -n "$t" ] || { echo "$log" >&2; echo "two-node-bench: cohort DiLoCo failed" >&2; exit 1; }
    per=$(awk -v s="${s:-0}" -v h="$sync_every" 'BEGIN { printf "%.1f", s / h }')
    rows+=("| $link | cohort DiLoCo, H = $sync_every | $t | $(ratio "$t" $(( 2 * single ))) | $(ratio "$t" "$pair") | $per ms (${s:-?} ms per sync) |")
  fi
  if selected diloco-overlap; then
    echo "link $link: cohort DiLoCo H=$sync_every, overlapped" >&2
    log=$(cohort_two_nodes --strategy diloco --sync-every "$sync_every" --outer-overlap)
    t=$(tok_s <<<"$log"); s=$(sync_ms <<<"$log")
    [ -n "$t" ] || { echo "$log" >&2; echo "two-node-bench: cohort DiLoCo overlapped failed" >&2; exit 1; }
    per=$(awk -v s="${s:-0}" -v h="$sync_every" 'BEGIN { printf "%.1f", s / h }')
    rows+=("| $link | cohort DiLoCo, H = $sync_every, overlapped | $t | $(ratio "$t" $(( 2 * single ))) | $(ratio "$t" "$pair") | $per ms (${s:-?} ms waited per sync) |")
  fi
  if [ "$torch" = 1 ]; then
    echo "link $link: PyTorch gloo DDP" >&2
    json=$(torch_two_nodes)
    t=$(python3 -c 'import json,sys; print(round(json.loads(sys.argv[1])["tokens_per_s_total"]))' "$json" 2>/dev/null || true)
    if [ -n "$t" ]; then
      rows+=("| $link | PyTorch gloo DDP | $t | $(ratio "$t" $(( 2 * torch_single ))) | - | - |")
    else
      tail -n 20 "$work/torch0.log" "$work/torch1.log" >&2
      rows+=("| $link | PyTorch gloo DDP | failed (its log above) | - | - | - |")
    fi
  fi
done

echo
echo "| link | system | tokens/s | efficiency | against independent ranks | exposed comm per step |"
echo "|---|---|---|---|---|---|"
printf '%s\n' "${rows[@]}"

#!/usr/bin/env bash
# Runs the headline benchmarks on two builds of cohort alternately, in the same minutes, for a
# change that must not move them (a restructuring): before (B) then after (A), two rounds, then
# ZeRO-3's peak memory and the main job's losses once each. Run it with nothing else running:
#   bash docs/bench/before_after.sh OLD/target/release/cohort target/release/cohort
set -u
B=${1:?usage: before_after.sh BEFORE_BIN AFTER_BIN}
A=${2:?usage: before_after.sh BEFORE_BIN AFTER_BIN}
B=$(realpath "$B"); A=$(realpath "$A")
cd "$(mktemp -d)"
for round in 1 2; do
  for who in B A; do
    bin=${!who}
    echo "== round $round $who"
    $bin bench train --config B --threads 1 --steps 8 --warmup 2 --json 2>&1 | tail -1
    $bin bench train --config G --threads 1 --steps 3 --warmup 1 --precision bf16 --json 2>&1 | tail -1
    $bin run -n 2 bench ddp --config A --json 2>&1 | grep -v "^cohort run" | tail -2
    $bin run -n 2 bench collectives -b 16M -e 16M --json 2>&1 | grep all_reduce | tail -1
    $bin bench serve --config B --generate --streams 1,32 --new-tokens 128 --json 2>&1 | tail -2
  done
done
for who in B A; do
  bin=${!who}
  echo "== zero3 G peak RSS $who"
  $bin run --standalone -n 2 bench ddp --config G --strategy zero3 --steps 1 --warmup 1 \
    --rounds 1 --baseline-tokens-per-s 1 --json 2>&1 | grep -v "^cohort run" | tail -2
  echo "== main job $who"
  $bin run -n 2 train 2>&1 | grep -E "done:|val loss" | tail -2
  $bin run -n 2 train --strategy zero3 --steps 60 2>&1 | grep -E "done:" | tail -1
done

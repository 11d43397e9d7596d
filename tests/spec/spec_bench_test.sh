#!/usr/bin/env bash
# bench/spec_bench, whose rows BENCHMARKS.md quotes, on the tiny golden checkpoint with an MTP layer
# (tests/golden/tiny_qlora): every proposer it has (n-gram and the MTP head) gets a row with all of
# the cost model's columns, adaptive k's guesses per step stay within 1..k, the MTP head's step is
# timed, and --profile's total / step starts at 1.
# Usage: tests/spec/spec_bench_test.sh [BUILD_DIR]
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
bench=${1:-$root/build}/spec_bench
model=$root/tests/golden/tiny_qlora
fail() { echo "FAIL: $*"; echo "$out"; exit 1; }
out=$("$bench" --model "$model" --threads 1 --k 1,3 --temperatures 0,0.7 --tokens 12 --markdown 2>&1) || fail "spec_bench exited $?"
rows=$(grep -c '^| ' <<<"$out")
[ "$rows" -eq 10 ] || fail "$rows rows, want 10 (2 temperatures x (none + 2 k x (ngram, mtp)))"
awk -F'|' '
  NF != 15 { print "row with " NF - 2 " columns: " $0; bad = 1; next }
  $5 ~ /mtp/ {
    k = $6 + 0; guesses = $11 + 0; proposer = $13 + 0
    if ($3 !~ /MTP head/) { print "mtp row without its MTP head: " $0; bad = 1 }
    if ($9 ~ /no guesses|-/) { print "the MTP head never guessed: " $0; bad = 1 }
    if (guesses < 1 || guesses > k) { print "guesses per step " guesses " outside 1.." k ": " $0; bad = 1 }
    if (proposer <= 0) { print "MTP step not timed: " $0; bad = 1 }
    if ($14 !~ /x *$/) { print "no predicted speedup: " $0; bad = 1 }
    mtp++
  }
  END { if (mtp != 4) { print mtp + 0 " mtp rows, want 4"; bad = 1 } exit bad }' <<<"$out" || fail "bad rows"
out=$("$bench" --model "$model" --threads 1 --k 2 --profile 2>&1) || fail "spec_bench --profile exited $?"
grep -Eq '^total / step +1\.000 +[0-9.]+$' <<<"$out" || fail "--profile: no total / step line starting at 1.000"
grep -q '^routed experts' <<<"$out" || fail "--profile: no routed experts line"
echo "spec_bench rows and profile: ok"

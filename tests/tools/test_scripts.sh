#!/usr/bin/env bash
# The scripts fail loudly: arguments are checked first, paths resolved before any change of
# folder, and a stage whose tool fails makes the whole script fail. The GPU tools are stubs on
# PATH (each stub does what its name says: a failing ncu, a passing test binary...), so this
# runs on any machine.
#
# usage: test_scripts.sh SOURCE_DIR
set -uo pipefail
root=$(cd "$1" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0

# expect NAME RC REGEX -- command...: the exit status is RC and stdout+stderr match REGEX.
expect() {
  local name=$1 rc=$2 regex=$3
  shift 4
  local got log=$work/log
  "$@" >"$log" 2>&1
  got=$?
  if [[ $got -ne $rc ]] || ! grep -qE -- "$regex" "$log"; then
    echo "FAIL $name: expected exit $rc and /$regex/, got exit $got:"
    sed 's/^/  | /' "$log"
    failures=$((failures + 1))
  else
    echo "ok   $name"
  fi
}

# A pack with a flashref and a test_cuda that pass, and GPU tools as stubs.
stub() {  # stub DIR NAME EXIT-STATUS [OUTPUT]
  mkdir -p "$1"
  printf '#!/bin/sh\necho "%s"\nexit %s\n' "${4:-$2 stub}" "$3" >"$1/$2"
  chmod +x "$1/$2"
}
pack=$work/pack
stub "$pack/bin" test_cuda 0 "All tests passed"
mkdir -p "$pack/lib"
cat >"$pack/bin/flashref" <<'STUB'
#!/bin/sh
# bench-gpu --json FILE: writes FILE
if [ "$1" = bench-gpu ] && [ "$2" = --json ]; then echo '[]' >"$3"; fi
echo "flashref stub $*"
STUB
chmod +x "$pack/bin/flashref"
tools=$work/tools
stub "$tools" nvidia-smi 0 "name, driver_version"
stub "$tools" compute-sanitizer 0 "ERROR SUMMARY: 0 errors"
stub "$tools" cuobjdump 0 "HMMA.16816"
stub "$tools" ncu 1 "==ERROR== profiling failed"
stub "$tools" python3 0 "torch stub"
base_path=$tools:/usr/bin:/bin

round=$root/scripts/gpu-round
expect "gpu-round without arguments" 2 "usage: scripts/gpu-round" -- "$round"
expect "gpu-round with three arguments" 2 "usage: scripts/gpu-round" -- "$round" a b c
expect "gpu-round with a missing pack" 2 "pack: expected a folder or a .tar.xz.*no such path" \
  -- env PATH="$base_path" "$round" "$work/out" "$work/no-such-pack"
expect "gpu-round with a pack without bin/flashref" 2 "pack: expected .*/bin/flashref" \
  -- env PATH="$base_path" "$round" "$work/out" "$work/tools"
expect "gpu-round with an unknown stage" 2 "GPU_ROUND_STAGES: expected .* got 'profle'" \
  -- env PATH="$base_path" GPU_ROUND_STAGES="tests profle" "$round" "$work/out" "$pack"
expect "gpu-round with an OUT_DIR that cannot be made" 2 "OUT_DIR: expected a folder" \
  -- env PATH="$base_path" "$round" "$pack/bin/flashref/out" "$pack"
stub "$work/smi-only" nvidia-smi 0 "name, driver_version"
expect "gpu-round without ncu for the profile stage" 2 "expected ncu on PATH" \
  -- env PATH="$work/smi-only:/usr/bin:/bin" GPU_ROUND_STAGES="profile" "$round" "$work/out" "$pack"
# A relative pack and OUT_DIR, from another folder: resolved before anything changes folder.
expect "gpu-round with relative paths, every stage passing" 0 "tests: exit 0.*" \
  -- env PATH="$base_path" GPU_ROUND_STAGES="tests sanitize bench" \
  bash -c "cd '$work' && '$round' rel-out pack"
[[ -f $work/rel-out/bench_cuda.json ]] || {
  echo "FAIL relative OUT_DIR: no $work/rel-out/bench_cuda.json"
  failures=$((failures + 1))
}
expect "gpu-round: a failing ncu fails the round" 1 "profile: exit 1" \
  -- env PATH="$base_path" GPU_ROUND_STAGES="tests profile" "$round" "$work/out" "$pack"
# The profile stage over the head dims asked for: ncu (a stub that prints its arguments) runs
# once per head dim and length.
mkdir -p "$work/ncu-ok"
printf '#!/bin/sh\necho "ncu $*"\n' >"$work/ncu-ok/ncu"
chmod +x "$work/ncu-ok/ncu"
expect "gpu-round: the profile stage at two head dims" 0 "profile: exit 0" \
  -- env PATH="$work/ncu-ok:$base_path" GPU_ROUND_STAGES="profile" GPU_PROFILE_HEAD_DIMS="64 128" \
  "$round" "$work/out-prof" "$pack"
for d in 64 128; do
  grep -q -- "--head-dims $d --masks dense" "$work/out-prof/profile.txt" || {
    echo "FAIL profile stage: no ncu run at D = $d in $work/out-prof/profile.txt"
    failures=$((failures + 1))
  }
done
expect "gpu-round: torch without a bench result fails, not skips" 1 "torch comparison: not run" \
  -- env PATH="$base_path" GPU_ROUND_STAGES="torch" "$round" "$work/out2" "$pack"
# The cpu stage: bench-cpu-vs-torch three times (fp32, its backward, bf16) with the pack's
# flashref, at GPU_CPU_THREADS; a python3 stub that logs its arguments stands in for it.
mkdir -p "$work/py-log"
printf '#!/bin/sh\necho "$*" >>"%s"\n' "$work/py-log/calls" >"$work/py-log/python3"
chmod +x "$work/py-log/python3"
expect "gpu-round: the cpu stage runs the three comparisons" 0 \
  "cpu against torch \(--dtype bf16\): exit 0" \
  -- env PATH="$work/py-log:$base_path" GPU_ROUND_STAGES="cpu" GPU_CPU_THREADS="16" \
  "$round" "$work/out-cpu" "$pack"
if [[ $(grep -c -- "bench-cpu-vs-torch $work/out-cpu --flashref $pack/bin/flashref --threads 16" \
  "$work/py-log/calls") -ne 3 ]] || ! grep -q -- "--threads 16 --backward$" "$work/py-log/calls"; then
  echo "FAIL cpu stage: expected three bench-cpu-vs-torch calls (fp32, --backward, --dtype bf16), got:"
  sed 's/^/  | /' "$work/py-log/calls"
  failures=$((failures + 1))
fi
stub "$work/py-fail" python3 1 "no torch here"
expect "gpu-round: a failing CPU comparison fails the round" 1 "cpu against torch \(--backward\): exit 1" \
  -- env PATH="$work/py-fail:$base_path" GPU_ROUND_STAGES="cpu" "$round" "$work/out-cpu2" "$pack"
stub "$work/failing-smi" nvidia-smi 9 "NVIDIA-SMI has failed"
expect "gpu-round: no usable GPU fails the round" 1 "nvidia-smi: exit 9" \
  -- env PATH="$work/failing-smi:$base_path" GPU_ROUND_STAGES="tests" "$round" "$work/out3" "$pack"
stub "$work/failing-pack/bin" test_cuda 1 "test cases: 3 | 1 failed"
cp "$pack/bin/flashref" "$work/failing-pack/bin/flashref"
expect "gpu-round: failing CUDA tests fail the round" 1 "tests: exit 1" \
  -- env PATH="$base_path" GPU_ROUND_STAGES="tests" "$round" "$work/out4" "$work/failing-pack"
# A kernel that never returns: the run is stopped after GPU_TEST_TIMEOUT and the round fails.
mkdir -p "$work/hanging-pack/bin"
printf '#!/bin/sh\nexec sleep 60\n' >"$work/hanging-pack/bin/test_cuda"
chmod +x "$work/hanging-pack/bin/test_cuda"
cp "$pack/bin/flashref" "$work/hanging-pack/bin/flashref"
expect "gpu-round: a hanging test run is stopped and fails the round" 1 "tests: exit 124" \
  -- env PATH="$base_path" GPU_ROUND_STAGES="tests" GPU_TEST_TIMEOUT=1 "$round" "$work/out5" \
  "$work/hanging-pack"

gpu_pack=$root/scripts/gpu-pack
expect "gpu-pack without arguments" 2 "usage: scripts/gpu-pack" -- "$gpu_pack"
expect "gpu-pack refuses to empty / as its pack folder" 2 "PACK_DIR: expected a folder of its own" \
  -- "$gpu_pack" /
expect "gpu-pack refuses the source tree" 2 "PACK_DIR: expected a folder of its own" \
  -- "$gpu_pack" "$root"

report=$root/scripts/conformance-report
expect "conformance-report without arguments" 2 "usage: scripts/conformance-report" -- "$report"
expect "conformance-report with a missing pack" 2 "no such path" \
  -- env PATH="$base_path" "$report" "$work/cr" "$work/no-such-pack"
expect "conformance-report with an OUT_DIR that cannot be made" 2 "OUT_DIR: expected a folder" \
  -- env PATH="$base_path" "$report" "$pack/bin/flashref/x" "$pack"

bench=$root/scripts/bench-cpu-vs-torch
expect "bench-cpu-vs-torch without flashref" 2 "flashref: expected an executable" \
  -- "$bench" "$work/b" --flashref "$work/no-such-flashref"
expect "bench-cpu-vs-torch with bad --threads" 2 "--threads: expected positive counts" \
  -- "$bench" "$work/b" --flashref "$pack/bin/flashref" --threads 2,x

ab=$root/scripts/bench-gpu-ab
expect "bench-gpu-ab without arguments" 2 "usage: bench-gpu-ab" -- "$ab"
expect "bench-gpu-ab with a missing pack" 2 "PACK_B: expected a folder or a .tar.xz.*no such path" \
  -- "$ab" "$work/ab" "$pack" "$work/no-such-pack"
expect "bench-gpu-ab with no rounds" 2 "--rounds: expected a positive count, got 0" \
  -- "$ab" "$work/ab" "$pack" "$pack" --rounds 0
# Packs whose bench-gpu reports one point, forward and backward: A at 100 TFLOP/s (backward 50),
# B at 110 (55), N at 120 (60) with a NaN. The two passes must stay apart in the table.
for side in a:100:0 b:110:0 n:120:1; do
  IFS=: read -r name rate nan <<<"$side"
  mkdir -p "$work/ab-$name/bin" "$work/ab-$name/lib"
  cat >"$work/ab-$name/bin/flashref" <<STUB
#!/bin/sh
# bench-gpu --json FILE ...: one record
echo '[{"backend": "cuda", "D": 128, "Lq": 1024, "mask": "dense", "density": 0, "dtype": "bfloat16", "kernel": "hopper", "tflops": $rate, "nan_count": $nan, "empty_rows_bad": 0},
  {"backend": "cuda", "pass": "backward", "D": 128, "Lq": 1024, "mask": "dense", "density": 0, "dtype": "bfloat16", "kernel": "hopper", "tflops": $((rate / 2)), "nan_count": 0, "empty_rows_bad": 0}]' >"\$3"
STUB
  chmod +x "$work/ab-$name/bin/flashref"
done
expect "bench-gpu-ab: B / A per point, best of the rounds" 0 "\\| forward \\| 128 \\| 1024 \\| dense \\| bfloat16 \\| hopper \\| hopper \\| 100.0 \\| 110.0 \\| 1.100 \\| 1.100 \\| none \\|" \
  -- "$ab" "$work/ab-out" "$work/ab-a" "$work/ab-b" --rounds 2 -- --lengths 1024
expect "bench-gpu-ab: the backward's points in rows of their own" 0 "\\| backward \\| 128 \\| 1024 \\| dense \\| bfloat16 \\| hopper \\| hopper \\| 50.0 \\| 55.0 \\| 1.100 \\| 1.100 \\| none \\|" \
  -- "$ab" "$work/ab-out4" "$work/ab-a" "$work/ab-b" --rounds 1 -- --lengths 1024 --backward
expect "bench-gpu-ab: a NaN at a point is flagged and fails the comparison" 1 "\\| 1.200 \\| 1.200 \\| B \\|" \
  -- "$ab" "$work/ab-out3" "$work/ab-a" "$work/ab-n" --rounds 1
expect "bench-gpu-ab: B as a bare flashref executable, run with A's libraries" 0 \
  "\\| forward \\| 128 \\| 1024 \\| dense \\| bfloat16 \\| hopper \\| hopper \\| 100.0 \\| 110.0 \\| 1.100 \\| 1.100 \\| none \\|" \
  -- "$ab" "$work/ab-out5" "$work/ab-a" "$work/ab-b/bin/flashref" --rounds 1 -- --lengths 1024
# One build, two modes: a pack that reports 130 TFLOP/s when it is given --fast, else 100.
mkdir -p "$work/ab-m/bin" "$work/ab-m/lib"
cat >"$work/ab-m/bin/flashref" <<'STUB'
#!/bin/sh
# bench-gpu --json FILE ...: one record, faster with --fast
out=$3
rate=100
for a in "$@"; do [ "$a" = --fast ] && rate=130; done
echo "[{\"backend\": \"cuda\", \"D\": 128, \"Lq\": 1024, \"mask\": \"dense\", \"density\": 0, \"dtype\": \"bfloat16\", \"kernel\": \"hopper\", \"tflops\": $rate, \"nan_count\": 0, \"empty_rows_bad\": 0}]" >"$out"
STUB
chmod +x "$work/ab-m/bin/flashref"
# A pack with one fast round in three (140 TFLOP/s in its second run, 100 otherwise): the best
# rounds give B / A 110 / 140, the medians 110 / 100.
mkdir -p "$work/ab-o/bin" "$work/ab-o/lib"
cat >"$work/ab-o/bin/flashref" <<STUB
#!/bin/sh
# bench-gpu --json FILE ...: one record, fast on the second call
n=\$(cat "$work/ab-o/calls" 2>/dev/null || echo 0)
n=\$((n + 1))
echo \$n >"$work/ab-o/calls"
rate=100
[ \$n -eq 2 ] && rate=140
echo "[{\\"backend\\": \\"cuda\\", \\"D\\": 128, \\"Lq\\": 1024, \\"mask\\": \\"dense\\", \\"density\\": 0, \\"dtype\\": \\"bfloat16\\", \\"kernel\\": \\"hopper\\", \\"tflops\\": \$rate, \\"nan_count\\": 0, \\"empty_rows_bad\\": 0}]" >"\$3"
STUB
chmod +x "$work/ab-o/bin/flashref"
expect "bench-gpu-ab: the median rounds' ratio beside the best rounds'" 0 \
  "\\| 140.0 \\| 110.0 \\| 0.786 \\| 1.100 \\| none \\|" \
  -- "$ab" "$work/ab-out8" "$work/ab-o" "$work/ab-b" --rounds 3 -- --lengths 1024
expect "bench-gpu-ab: --b-args go to B's runs alone" 0 \
  "\\| forward \\| 128 \\| 1024 \\| dense \\| bfloat16 \\| hopper \\| hopper \\| 100.0 \\| 130.0 \\| 1.300 \\| 1.300 \\| none \\|" \
  -- "$ab" "$work/ab-out6" "$work/ab-m" "$work/ab-m" --rounds 1 --b-args=--fast -- --lengths 1024
expect "bench-gpu-ab with unbalanced --b-args" 2 "--b-args: expected arguments as a shell would split them" \
  -- "$ab" "$work/ab-out7" "$work/ab-m" "$work/ab-m" --b-args "'--fast"
stub "$work/ab-fail/bin" flashref 3 "bench-gpu failed"
mkdir -p "$work/ab-fail/lib"
expect "bench-gpu-ab: a failing build fails the comparison" 1 "B round 1: exit 3" \
  -- "$ab" "$work/ab-out2" "$work/ab-a" "$work/ab-fail" --rounds 1

ptx=$root/scripts/check-ptxas-report
cat >"$work/ptxas-clean.log" <<'LOG'
ptxas info    : Compiling entry function '_Z6kernelv' for 'sm_90a'
ptxas info    : Function properties for _Z6kernelv
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers
LOG
cp "$work/ptxas-clean.log" "$work/ptxas-frame.log"
cat >>"$work/ptxas-frame.log" <<'LOG'
ptxas info    : Compiling entry function '_Z4treev' for 'sm_90a'
ptxas info    : Function properties for _Z4treev
    64 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
LOG
cp "$work/ptxas-clean.log" "$work/ptxas-serial.log"
cat >>"$work/ptxas-serial.log" <<'LOG'
ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized due to insufficient register resources for the function '_Z2dqv'
LOG
echo "nothing compiled" >"$work/ptxas-none.log"
expect "check-ptxas-report: a clean report" 0 "1 functions reported, 0 findings" -- "$ptx" "$work/ptxas-clean.log"
expect "check-ptxas-report: a stack frame without spills is a finding" 1 \
  "_Z4treev \(sm_90a\): 64 bytes stack frame, 0 bytes spill stores" -- "$ptx" "$work/ptxas-frame.log"
expect "check-ptxas-report: serialised wgmma is a finding" 1 "_Z2dqv \(sm_90a\): wgmma serialised" \
  -- "$ptx" "$work/ptxas-serial.log"
expect "check-ptxas-report: a log without a report" 2 "expected ptxas resource lines" \
  -- "$ptx" "$work/ptxas-none.log"
expect "check-ptxas-report: a missing log" 2 "BUILD_LOG: expected a readable file" \
  -- "$ptx" "$work/no-such.log"

# scripts/check-sass-overlap: the overlapped loop's exponentials between its two waits.
sass=$root/scripts/check-sass-overlap
overlapped_loop() {  # overlapped_loop EXPONENTIALS: SASS of one kernel's loop body
  echo "        Function : _Z13hopper_kernelILi128EEvv"
  echo "        /*0100*/  HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24, gsb0 ;"
  echo "        /*0110*/  WARPGROUP.DEPBAR.LE gsb0, 0x1 ;"
  for ((n = 0; n < $1; ++n)); do echo "        /*0120*/  MUFU.EX2 R24, R24 ;"; done
  echo "        /*0130*/  WARPGROUP.DEPBAR.LE gsb0, 0x0 ;"
}
overlapped_loop 64 >"$work/sass-ok.txt"
{
  overlapped_loop 66
  echo "        Function : _Z13hopper_kernelILi176EEvv"
  echo "        /*0110*/  WARPGROUP.DEPBAR.LE gsb0, 0x1 ;"
  echo "        /*0130*/  WARPGROUP.DEPBAR.LE gsb0, 0x0 ;"
  echo "        /*0140*/  MUFU.EX2 R24, R24 ;"
} >"$work/sass-hoisted.txt"
echo "        Function : _Z6serialv" >"$work/sass-none.txt"
expect "check-sass-overlap: the softmax between the waits" 0 "1 kernels with the overlapped loop, 0 findings" \
  -- "$sass" "$work/sass-ok.txt"
expect "check-sass-overlap: the wait for P V ahead of the softmax is a finding" 1 \
  "_Z13hopper_kernelILi176EEvv: 0 MUFU.EX2 between the wait for S and the wait for P V" \
  -- "$sass" "$work/sass-hoisted.txt"
expect "check-sass-overlap: fewer exponentials than asked for" 1 "64 MUFU.EX2 between" \
  -- "$sass" "$work/sass-ok.txt" 65
expect "check-sass-overlap: SASS without the loop" 2 "expected SASS of a Hopper kernel" \
  -- "$sass" "$work/sass-none.txt"
expect "check-sass-overlap: a missing file" 2 "SASS_FILE: expected a readable file" \
  -- "$sass" "$work/no-such.txt"

# scripts/gpu-tables: a round's JSON as the docs' tables, or one line naming what is wrong.
tables=$root/scripts/gpu-tables
mkdir -p "$work/round-empty" "$work/round-bad" "$work/round-ok"
echo '{"not": "a list"}' >"$work/round-bad/bench_torch.json"
cat >"$work/round-ok/bench_torch.json" <<'JSON'
[{"D": 64, "Lq": 1024, "mask": "dense", "density": 1.0, "visible_fraction": 1.0,
  "median_s": 0.0004, "tflops": 343.6, "flash_tflops": 270.5, "cudnn_tflops": 392.5,
  "flex_tflops": 254.7, "ours_over_flash": 1.27, "ours_over_cudnn": 0.875,
  "ours_over_flex": 1.349, "nan_count": 0},
 {"D": 64, "Lq": 1024, "mask": "block_sparse", "density": 0.2, "visible_fraction": 0.184,
  "median_s": 0.0001, "tflops": 161.5, "flash_tflops": null, "cudnn_tflops": null,
  "flex_tflops": 95.9, "ours_over_flash": null, "ours_over_cudnn": null,
  "ours_over_flex": 1.684, "nan_count": 0}]
JSON
expect "gpu-tables without arguments" 2 "usage: scripts/gpu-tables RESULTS_DIR" -- "$tables"
expect "gpu-tables with a missing folder" 2 "RESULTS_DIR: expected a folder" \
  -- "$tables" "$work/no-such-round"
expect "gpu-tables with no JSON" 2 "expected bench_torch.json, bench_torch_backward.json or paired.json" \
  -- "$tables" "$work/round-empty"
expect "gpu-tables with a JSON that is not a list" 2 "bench_torch.json: expected a JSON list" \
  -- "$tables" "$work/round-bad"
mkdir -p "$work/round-short"
echo '[{"D": 64, "Lq": 1024, "mask": "dense"}]' >"$work/round-short/bench_torch.json"
expect "gpu-tables with a record that lacks a field" 2 "record 0: expected a field 'visible_fraction'" \
  -- "$tables" "$work/round-short"
expect "gpu-tables renders the rows, n/a where a baseline did not run" 0 \
  "\| 64 \| 1024 \| block-sparse 0.2 \| 0.184 \| 0.100 \| 161.5 \| n/a \| n/a \| 95.9 \| n/a \| n/a \| 1.68 \| 0.250 \| 0 \|" \
  -- "$tables" "$work/round-ok"
# The paired stage's JSON (scripts/bench_gpu_paired.py): each kernel's times per round.
mkdir -p "$work/round-paired" "$work/round-paired-bad"
cat >"$work/round-paired/paired_backward.json" <<'JSON'
[{"pass": "backward", "B": 1, "Hq": 16, "L": 16384, "D": 128, "mask": "dense", "rounds": 3,
  "kernels": {
   "flashref": {"times_s": [0.010, 0.011, 0.012], "median_s": 0.011, "tflops": 500.0},
   "flashref_nondet": {"times_s": [0.010, 0.010, 0.010], "median_s": 0.010, "tflops": 550.0},
   "cudnn": {"times_s": [0.0095, 0.0099, 0.0132], "median_s": 0.0099, "tflops": 555.6},
   "flash": {"times_s": [0.018, 0.018, 0.018], "median_s": 0.018, "tflops": 305.6}}},
 {"pass": "forward", "B": 1, "Hq": 32, "L": 16384, "D": 64, "mask": "block_sparse",
  "density": 0.2, "rounds": 2, "kernels": {
   "flashref": {"times_s": [0.001, 0.002], "median_s": 0.0015, "tflops": 340.0},
   "flex": {"times_s": [0.0013, 0.0018], "median_s": 0.00155, "tflops": 330.0}}}]
JSON
echo '[{"pass": "forward", "D": 64}]' >"$work/round-paired-bad/paired.json"
expect "gpu-tables renders the paired rounds: medians and ranges of the per-round ratios" 0 \
  "\| backward \| 128 \| 16384 \| dense \| 3 \| 11.000 \| 500.0 \| 555.6 \| 0.950 \| 0.900–1.100 \| 305.6 \| 1.636 \| n/a \| n/a \| n/a \| 550.0 \| 0.990 \|" \
  -- "$tables" "$work/round-paired"
expect "gpu-tables renders a paired block-sparse point against FlexAttention alone" 0 \
  "\| forward \| 64 \| 16384 \| block-sparse 0.2 \| 2 \| 1.500 \| 340.0 \| n/a \| n/a \| n/a \| n/a \| n/a \| 330.0 \| 1.100 \| 0.900–1.300 \| n/a \| n/a \|" \
  -- "$tables" "$work/round-paired"
# Records of single calls (--single-calls) make a table of their own, under its own heading.
mkdir -p "$work/round-paired-single"
sed 's/"rounds": 3,/"rounds": 3, "back_to_back": false,/' "$work/round-paired/paired_backward.json" \
  >"$work/round-paired-single/paired_backward.json"
expect "gpu-tables puts single calls under their own heading" 0 \
  "^In turns, one process, single calls \(each synchronised\):$" \
  -- "$tables" "$work/round-paired-single"
# The stream's forward row before that heading, the single calls' backward row after it.
awk '/single calls/ { h = NR } /^\| forward \| 64 / { f = NR } /^\| backward \| 128 / { b = NR }
     END { exit !(h && f && b && f < h && h < b) }' "$work/log" || {
  echo "FAIL gpu-tables: expected the forward (streams) above and the backward (single calls) below the heading:"
  sed 's/^/  | /' "$work/log"
  failures=$((failures + 1))
}
# Records with the calls' host parts gain two columns: flashref's and the baseline's, in µs.
mkdir -p "$work/round-paired-host"
sed -e 's/"median_s": 0.011, "tflops": 500.0}/"median_s": 0.011, "tflops": 500.0, "host_s": 0.0000412}/' \
  -e 's/"median_s": 0.0099, "tflops": 555.6}/"median_s": 0.0099, "tflops": 555.6, "host_s": 0.000405}/' \
  "$work/round-paired/paired_backward.json" >"$work/round-paired-host/paired_backward.json"
expect "gpu-tables adds the host parts where the records carry them" 0 \
  "\| backward \| 128 \| 16384 \| dense \| 3 \| 11.000 \| .* \| 550.0 \| 0.990 \| 41.2 \| 405.0 \|$" \
  -- "$tables" "$work/round-paired-host"
expect "gpu-tables: a record without them shows n/a there" 0 \
  "\| forward \| 64 \| 16384 \| block-sparse 0.2 \| .* \| n/a \| n/a \| n/a \| n/a \|$" \
  -- "$tables" "$work/round-paired-host"
expect "gpu-tables with a paired record without kernels" 2 "paired.json: record 0: expected the kernels of bench_gpu_paired.py" \
  -- "$tables" "$work/round-paired-bad"

# scripts/targets: the issues' targets judged from a run's JSON, or one line naming what is wrong.
targets=$root/scripts/targets
expect "targets without arguments" 2 "usage: scripts/targets RESULTS_DIR" -- "$targets"
expect "targets with no JSON" 2 "expected bench_torch.json, bench_torch_backward.json, bench_cpu.json or a comparison" \
  -- "$targets" "$work/round-empty"
expect "targets with a JSON that is not a list" 2 "bench_torch.json: expected a JSON list" \
  -- "$targets" "$work/round-bad"
expect "targets with a record that lacks a field" 2 "record 0: expected a field 'visible_fraction'" \
  -- "$targets" "$work/round-short"
# round-ok: one dense and one block-sparse point at D = 64, L = 1024.
expect "targets: a target none of whose points ran says so" 0 \
  "\| block-sparse D = 64, L ≥ 2048: ≥ 1.3 × FlexAttention \| – \| not measured \| – \|" \
  -- "$targets" "$work/round-ok"
expect "targets: a point short of its target" 0 \
  "\| L = 512 and 1024, dense and causal: ≥ 0.9 × cuDNN \| D = 64, L = 1024, dense \| 0.875 × \| no \|" \
  -- "$targets" "$work/round-ok"
mkdir -p "$work/round-targets"
cat >"$work/round-targets/bench_torch.json" <<'JSON'
[{"D": 64, "Lq": 4096, "mask": "dense", "density": 1.0, "visible_fraction": 1.0,
  "median_s": 0.010, "ours_over_cudnn": 1.01, "nan_count": 0},
 {"D": 64, "Lq": 4096, "mask": "block_sparse", "density": 0.5, "visible_fraction": 0.44,
  "median_s": 0.0055, "time_vs_dense": 0.55, "ours_over_flex": 1.35, "nan_count": 0},
 {"D": 64, "Lq": 4096, "mask": "block_sparse", "density": 0.2, "visible_fraction": 0.18,
  "median_s": 0.0021, "time_vs_dense": 0.21, "ours_over_flex": 1.25, "nan_count": 1},
 {"D": 64, "Lq": 16384, "mask": "block_sparse", "density": 0.05, "visible_fraction": 0.04,
  "median_s": 0.001, "time_vs_dense": 0.08, "ours_over_flex": 1.5, "nan_count": 0},
 {"D": 64, "Lq": 16384, "mask": "block_sparse", "density": 0.2, "visible_fraction": 0.18,
  "median_s": 0.002, "time_vs_dense": 0.2, "ours_over_flex": 1.4, "nan_count": 0}]
JSON
expect "targets: the worst of several points, and how many met" 0 \
  "\| block-sparse D = 64, L ≥ 2048: ≥ 1.3 × FlexAttention \| 4 points \| 1.250 × to 1.500 ×; worst 1.250 × at D = 64, L = 4096, bs 0.2 \| no \(3 of 4\) \|" \
  -- "$targets" "$work/round-targets"
expect "targets: time over dense against d + 0.05" 0 \
  "\| block-sparse D = 64, L ≥ 2048: time ≤ \(d \+ 0.05\) × dense, d the visible fraction \| 4 points \| d \+ 0.020 to d \+ 0.110; worst d \+ 0.110 at D = 64, L = 4096, bs 0.5 \| no \(3 of 4\) \|" \
  -- "$targets" "$work/round-targets"
expect "targets: a NaN at any point fails the NaN row" 0 \
  "\| no NaN at any point \| 5 points \| rows with a NaN: 1 \| no \|" \
  -- "$targets" "$work/round-targets"
mkdir -p "$work/round-cpu"
cat >"$work/round-cpu/bench_cpu.json" <<'JSON'
[{"backend": "peak_fma", "gflops": 230.0},
 {"backend": "cpu", "D": 128, "Lq": 4096, "mask": "dense", "density": 1.0, "note": "target",
  "gflops": 200.0, "median_s": 0.35, "threads": 2, "isa": "avx512", "peak_fraction": 0.87},
 {"backend": "cpu_backward", "D": 128, "Lq": 4096, "mask": "dense", "density": 1.0,
  "note": "target, 0.75 x the forward's GFLOP/s", "gflops": 150.0, "median_s": 0.9,
  "threads": 2, "isa": "avx512"},
 {"backend": "cpu_backward", "D": 128, "Lq": 4096, "mask": "block_sparse", "density": 0.17,
  "note": "target", "gflops": 150.0, "median_s": 0.18, "threads": 2, "isa": "avx512"}]
JSON
expect "targets: the CPU forward's share of peak" 0 \
  "\| forward, dense: ≥ 75 % of the measured FMA peak \| D = 128, L = 4096, dense, 2 threads, avx512 \| 87 % \| \*\*yes\*\* \|" \
  -- "$targets" "$work/round-cpu"
expect "targets: the CPU backward against its forward" 0 \
  "\| backward, dense: ≥ 0.8 × the forward's GFLOP/s \| D = 128, L = 4096, dense, 2 threads, avx512 \| 0.750 × \| no \|" \
  -- "$targets" "$work/round-cpu"
expect "targets: the CPU backward's block-sparse time over its dense time" 0 \
  "\| backward, block-sparse at density 0.2: time ≤ 0.30 × dense \| visible 0.170, 2 threads, avx512 \| 0.200 × \| \*\*yes\*\* \|" \
  -- "$targets" "$work/round-cpu"
echo '[{"backend": "cpu", "D": 128}]' >"$work/round-cpu/bench_cpu.json"
expect "targets with a CPU record that lacks a field" 2 "a 'cpu' record: expected a field 'Lq'" \
  -- "$targets" "$work/round-cpu"
mkdir -p "$work/round-cmp"
cat >"$work/round-cmp/comparison.json" <<'JSON'
[{"backend": "cpu", "threads": 16, "mask": "dense", "D": 128, "Lq": 4096, "median_s": 0.10,
  "gflops": 1000.0, "isa": "avx512"},
 {"backend": "torch_sdpa", "threads": 16, "mask": "dense", "D": 128, "Lq": 4096, "median_s": 0.15,
  "gflops": 667.0},
 {"backend": "cpu", "threads": 16, "mask": "causal", "D": 64, "Lq": 1024, "median_s": 0.10,
  "gflops": 500.0, "isa": "avx512"},
 {"backend": "torch_sdpa", "threads": 16, "mask": "causal", "D": 64, "Lq": 1024, "median_s": 0.11,
  "gflops": 455.0}]
JSON
cat >"$work/round-cmp/comparison_bf16.json" <<'JSON'
[{"backend": "cpu", "threads": 16, "mask": "dense", "D": 128, "Lq": 4096, "median_s": 0.03,
  "gflops": 3300.0, "isa": "avx512+amx"},
 {"backend": "torch_sdpa", "threads": 16, "mask": "dense", "D": 128, "Lq": 4096, "median_s": 0.06,
  "gflops": 1650.0}]
JSON
expect "targets: the CPU against PyTorch, the worst point named" 0 \
  "\| forward fp32, 16 threads: ≥ 1.25 × PyTorch \| D = 128, L = 4096, dense, 16 threads / D = 64, L = 1024, causal, 16 threads \| 1.500 × / 1.100 ×; worst 1.100 × at D = 64, L = 1024, causal, 16 threads \| no \(1 of 2\) \|" \
  -- "$targets" "$work/round-cmp"
expect "targets: a thread count the comparison did not run" 0 \
  "\| forward fp32, 2 threads: ≥ 1.25 × PyTorch \| – \| not measured \| – \|" \
  -- "$targets" "$work/round-cmp"
expect "targets: bf16 against PyTorch's bf16" 0 \
  "\| forward bf16, 16 threads: ≥ 1.25 × PyTorch's bf16 \| D = 128, L = 4096, dense, 16 threads \| 2.000 × \| \*\*yes\*\* \|" \
  -- "$targets" "$work/round-cmp"
expect "targets: bf16 on AMX over our fp32 at the same point" 0 \
  "\| forward bf16 on AMX, 16 threads: ≥ 3 × our fp32 \| D = 128, L = 4096, dense, 16 threads \| 3.300 × \| \*\*yes\*\* \|" \
  -- "$targets" "$work/round-cmp"
echo '[{"backend": "cpu", "threads": 2}]' >"$work/round-cmp/comparison_backward.json"
expect "targets with a comparison record that lacks a field" 2 \
  "comparison_backward.json: record 0: expected a field 'mask'" -- "$targets" "$work/round-cmp"

# The paired stage: skipped with a note where the pack has no wheel, run (forward and
# backward) where it has one.
expect "gpu-round: the paired stage without a wheel is skipped" 0 "paired: skipped \(no wheel in the pack" \
  -- env PATH="$base_path" GPU_ROUND_STAGES="paired" "$round" "$work/out-paired" "$pack"
cp -r "$pack" "$work/pack-wheel"
mkdir -p "$work/pack-wheel/wheels"
touch "$work/pack-wheel/wheels/flashref-0.0.0-cp312-cp312-linux_x86_64.whl"
expect "gpu-round: the paired stage runs both passes through the wheel" 0 \
  "paired forward: exit 0.*" \
  -- env PATH="$base_path" GPU_ROUND_STAGES="paired" "$round" "$work/out-paired" "$work/pack-wheel"
grep -q "paired backward: exit 0" "$work/out-paired/summary.txt" || {
  echo "FAIL the paired stage: no backward run in $work/out-paired/summary.txt"
  failures=$((failures + 1))
}

if [[ $failures -ne 0 ]]; then
  echo "$failures script checks failed"
  exit 1
fi
echo "every script check passed"

#!/usr/bin/env bash
# The paper's ImageNet-C grid (severity 5, ViT-B/16, batch 64, δ = 1e-6), a dptta.py run a cell:
# 2 settings x 3 seeds x (source + 5 methods x {non-private, clip-only, ε = 20 15 10 5 1}) = 216.
#   ./run_imagenet_c.sh --dry-run   print the cells' commands, one a line; run nothing
#   ./run_imagenet_c.sh             run them, a worker per visible GPU (one CPU if none); summarize
# Environment: METHODS, VARIANTS (plain clip dp), EPSILONS, SETTINGS, SEEDS (lists of words); OUT
# (results.jsonl: a cell finished there is skipped); FISHER_DATA (EATA's public clean images, not
# ImageNet val); EXTRA (flags for every cell, none the grid sets); PYTHON (python3); IMAGENET_C.
# Paths are the caller's. A bad value stops the grid before its first cell (exit 2); a failed cell
# or summary is named, the others run, and the grid exits 1; Ctrl-C or SIGTERM stops it all.
set -euo pipefail
set -f  # no globbing: a cell's and EXTRA's words reach dptta.py as --dry-run prints them
dptta="$(dirname "$0")/dptta.py"  # (no cd: OUT, IMAGENET_C and FISHER_DATA stay the caller's)
die() { echo "run_imagenet_c.sh: $*" >&2; exit 2; }
case "$*" in "") dry=0 ;; --dry-run) dry=1 ;; *) die "unknown argument $* (only --dry-run)" ;; esac
METHODS=${METHODS-source tent eata sar deyo deyo_come}; VARIANTS=${VARIANTS-plain clip dp}
EPSILONS=${EPSILONS-20 15 10 5 1}; SETTINGS=${SETTINGS-continual episodic}; SEEDS=${SEEDS-0 1 2}
OUT=${OUT:-results.jsonl}; EXTRA=${EXTRA:-}; PYTHON=${PYTHON:-python3}; FISHER_DATA=${FISHER_DATA:-}
check() {  # check NAME REGEX WHAT: each word of $NAME matches REGEX; set but empty is refused
  [[ ${!1} =~ [^[:space:]] ]] || die "$1 is empty: unset it, or give it $3"
  for word in ${!1}; do [[ $word =~ ^($2)$ ]] || die "$1: '$word' is not $3"; done
}
check METHODS 'source|tent|eata|sar|deyo|deyo_come' "one of source tent eata sar deyo deyo_come"
check VARIANTS 'plain|clip|dp' "one of plain clip dp"
check SETTINGS 'continual|episodic' "one of continual episodic"
check SEEDS '-?(0|[1-9][0-9]{0,17})' "an integer (of 18 digits at most)"
# ε: a decimal with a digit that is not 0 (0, 0.0, 0e5 are not > 0), and maybe an exponent
check EPSILONS '([0-9]*[1-9][0-9]*\.?[0-9]*|[0-9]*\.[0-9]*[1-9][0-9]*)([eE][-+]?[0-9]+)?' "a number > 0"
for word in $EXTRA; do  # a flag the grid sets: EXTRA's, the last, would win over the cell's
  case ${word%%=*} in
    --fisher-data) die "EXTRA: --fisher-data goes in FISHER_DATA (EATA's cells alone)" ;;
    --method | --eps | --clip | --hp | --setting | --seed | --out | --device | --benchmark | --summarize)
      die "EXTRA: ${word%%=*} is the grid's own, set for each cell by its variables" ;;
  esac
done
if [ $dry = 0 ]; then
  [ -d "${IMAGENET_C:-}" ] || die "IMAGENET_C='${IMAGENET_C:-}' is not a folder: set it to ImageNet-C's root"
  [ -d "$(dirname "$OUT")" ] || die "OUT=$OUT: its folder $(dirname "$OUT") is not there"
  [ ! -e "$OUT" ] || [ -f "$OUT" ] || die "OUT=$OUT is not a regular file: its records would be lost"
  [ -z "$FISHER_DATA" ] || [ -d "$FISHER_DATA" ] || die "FISHER_DATA=$FISHER_DATA is not a folder"
  command -v "$PYTHON" > /dev/null || die "PYTHON=$PYTHON is not a command"
fi
# A clip-only cell passes the paper's clip-only C, a filtered one the constants the paper's
# scripts changed (a test ties them to dptta.py's tables); dptta.py fills in the rest
declare -A CLIP_ONLY_C=(
  [continual/tent]=0.1 [continual/eata]=0.1 [continual/sar]=1 [continual/deyo]=10
  [continual/deyo_come]=20 [episodic/tent]=1 [episodic/eata]=30 [episodic/sar]=5
  [episodic/deyo]=35 [episodic/deyo_come]=20)
declare -A CONSTANTS=([sar]="--hp e_margin=0.5" [deyo]="--hp plpd_threshold=0.3"
  [deyo_come]="--hp plpd_threshold=0.3")
cells=()  # each a line of dptta.py flags
for setting in $SETTINGS; do for seed in $SEEDS; do for method in $METHODS; do
  run="--setting $setting --seed $seed" filters=${CONSTANTS[$method]:-}
  if [ "$method" = source ]; then cells+=("--method source $run"); continue; fi
  for variant in $VARIANTS; do
    case $variant in
      plain) cells+=("--method $method ${filters:+$filters }$run") ;;
      clip) cells+=("--method $method --clip ${CLIP_ONLY_C[$setting/$method]} ${filters:+$filters }$run") ;;
      dp) for eps in $EPSILONS; do cells+=("--method dp_$method --eps $eps $run"); done ;;
    esac
  done
done; done; done
# Every cell, once, before the first runs: PYTHON imports dptta, which parses the cell with EXTRA (a
# list of words), serves its ε, finds the folder of every stream it reads, and no two cells are one
# run (SEEDS="0 0", EPSILONS="5 5.0": two processes would release the same images twice)
check='import os, sys; sys.path.insert(0, sys.argv[1]); import dptta
keys = set()
for cell in sys.stdin.read().splitlines():
    args = dptta.parse_args(cell.split() + sys.argv[2:])
    if args.eps is not None: dptta.calibrate_sigma(eps=args.eps, delta=args.delta)
    key = str(dptta.run_key(args, dict(args.hp)))
    dptta.require(key not in keys, f"{cell}: a cell twice")
    keys.add(key)
    for c in args.corruptions:
        root = os.path.join(args.data, c, str(args.severity))
        dptta.require(args.dataset == "imagenet_r" or os.path.isdir(root), f"no {root}: not ImageNet-C")'
if [ $dry = 0 ] && ! why=$("$PYTHON" -c "$check" "$(dirname "$dptta")" $EXTRA 2>&1 > /dev/null \
    <<< "$(printf '%s\n' "${cells[@]}")"); then die "PYTHON=$PYTHON, EXTRA=$EXTRA: ${why##*$'\n'}"; fi
gpus=()  # CUDA_VISIBLE_DEVICES's where it is set ("" is none), else nvidia-smi's
if [ -n "${CUDA_VISIBLE_DEVICES+set}" ]; then
  IFS=, read -r -a gpus <<< "$CUDA_VISIBLE_DEVICES"
elif command -v nvidia-smi > /dev/null; then
  listing=$(timeout 5 nvidia-smi -L 2> /dev/null) ||
    { listing=; echo "run_imagenet_c.sh: nvidia-smi failed or hung: no GPU, the cells run on the CPU" >&2; }
  for (( g = 0; g < $(grep -c '^GPU' <<< "$listing" || true); g++ )); do gpus+=("$g"); done
fi
if [ ${#gpus[@]} = 0 ]; then device="--device cpu"; else device=; fi  # (GPUs: dptta.py picks its worker's)
nworkers=$(( ${#gpus[@]} > 0 ? ${#gpus[@]} : 1 ))
argv_of() {  # argv: cell $1's dptta.py arguments (a cell, $device and EXTRA: lists of words)
  argv=(${cells[$1]} --out "$OUT" $device)
  if [ -n "$FISHER_DATA" ] && [[ ${cells[$1]} =~ ^--method\ (dp_)?eata\  ]]; then argv+=(--fisher-data "$FISHER_DATA"); fi
  argv+=($EXTRA)
}
command_of() { argv_of "$1"; line=$(printf '%q ' "$PYTHON" "$dptta" "${argv[@]}"); echo "${line% }"; }
if [ $dry = 1 ]; then for j in "${!cells[@]}"; do command_of "$j"; done; exit 0; fi
worker() {  # worker g: cells g, g + n, g + 2n, ... one after another, on GPU g
  local g=$1 j failed=0
  if [ ${#gpus[@]} -gt 0 ]; then export CUDA_VISIBLE_DEVICES=${gpus[$g]}; fi
  for (( j = g; j < ${#cells[@]}; j += nworkers )); do
    argv_of "$j"
    "$PYTHON" "$dptta" "${argv[@]}" && continue
    echo "run_imagenet_c.sh: cell failed (exit $?): $(command_of "$j")" >&2
    failed=1
  done
  return $failed
}
echo "run_imagenet_c.sh: ${#cells[@]} cells on $nworkers worker(s) -> $OUT"
set -m  # each worker in a process group of its own, which a stop ends whole: it and its cell
pids=() failed=0
stop() {  # every worker's process group: the worker and the cell it runs
  trap - INT TERM; echo "run_imagenet_c.sh: stopping ${#pids[@]} worker(s)" >&2
  for pid in "${pids[@]}"; do kill -TERM -- "-$pid" 2> /dev/null || true; done
  wait 2> /dev/null; exit "$1"  # (not bash's "Terminated" line for each)
}
trap 'stop 130' INT; trap 'stop 143' TERM  # (before the first worker starts: none is left behind)
for (( g = 0; g < nworkers; g++ )); do worker "$g" & pids+=($!); done
for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
trap - INT TERM; set +m
"$PYTHON" "$dptta" --summarize "$OUT" || { echo "run_imagenet_c.sh: the summary failed" >&2; failed=1; }
[ $failed = 0 ] || { echo "run_imagenet_c.sh: some cells failed (each named above): the grid is incomplete" >&2; exit 1; }

#!/usr/bin/env bash
# Reproduce the paper's ImageNet-C tables (severity 5, ViT-B/16, batch 64) with dptta.py.
#
#   ./run_imagenet_c.sh --dry-run      print the grid (one dptta.py command per cell) and stop
#   ./run_imagenet_c.sh                main grid with the paper's C and lr, on every local GPU
#   ./run_imagenet_c.sh tune           choose C and lr on the 4 held-out corruptions -> $TUNED
#   ./run_imagenet_c.sh --tuned        main grid with the C and lr from $TUNED instead of the paper's
#   sbatch --array=0-$(( $(./run_imagenet_c.sh --count) - 1 )) --gres=gpu:1 run_imagenet_c.sh
#                                      SLURM (submit from the repo): each array task runs one cell
#                                      (add "tune" or "--tuned" after the script name as above)
# Environment: IMAGENET_C (data root), SEEDS ("0 1 2"), SETTINGS ("continual episodic"),
#   OUT (results.jsonl), TUNE_OUT (tune.jsonl), TUNED (tuned.json), EXTRA (more dptta.py flags,
#   e.g. "--limit 2000 --fisher-data /data/imagenet/val").
# Resumable: every cell runs with --resume, so cells already in $OUT are skipped.
# Hardware and time (an estimate, not measured here): ViT-B/16 in bf16 on one H100-class GPU
#   streams roughly 1,000 images/s; a cell is 15 x 50,000 images, ~13 min. The main grid is
#   (1 source + 5 methods x 7 columns) x 2 settings = 72 cells per seed, ~16 GPU-hours per seed.
#   The tune stage is 5 x 45 x 6 x 2 = 2,700 cells on 4 corruptions: use EXTRA="--limit 2000".
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")}"  # sbatch runs a spooled copy of this script: go back to the repo
SEEDS=${SEEDS:-"0 1 2"}; SETTINGS=${SETTINGS:-"continual episodic"}
OUT=${OUT:-results.jsonl}; TUNE_OUT=${TUNE_OUT:-tune.jsonl}; TUNED=${TUNED:-tuned.json}; EXTRA=${EXTRA:-}
stage=main; dry=0; count=0; tuned=0
for arg in "$@"; do
  case $arg in
    --dry-run) dry=1 ;; --count) count=1 ;; --tuned) tuned=1 ;; tune|main) stage=$arg ;;
    *) echo "run_imagenet_c.sh: unknown argument $arg (see the header)" >&2; exit 2 ;;
  esac
done
[ $tuned = 1 ] && [ ! -f "$TUNED" ] && { echo "run_imagenet_c.sh: $TUNED missing: run the tune stage first" >&2; exit 2; }

# One line of dptta.py flags per cell, from dptta's own tables of the paper's values.
grid() {
  STAGE=$stage SEEDS=$SEEDS SETTINGS=$SETTINGS TUNED=$([ $tuned = 1 ] && echo "$TUNED") python3 - <<'PY'
import itertools, json, os
import dptta
seeds, settings = os.environ["SEEDS"].split(), os.environ["SETTINGS"].split()
tuned = json.load(open(os.environ["TUNED"])) if os.environ["TUNED"] else {}
methods, epsilons = ("tent", "eata", "sar", "deyo", "deyo_come"), (20, 15, 10, 5, 1)
if os.environ["STAGE"] == "tune":  # the paper's grid, on held-out corruptions only
    for setting, seed, m, col, C, lr in itertools.product(
            settings, seeds[:1], methods, ("clip-only",) + epsilons, (0.1, 1, 5, 10, 15),
            (1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5, 1)):
        how = f"--method {m}" if col == "clip-only" else f"--method dp_{m} --eps {col}"
        print(f"{how} --clip {C} --lr {lr} --setting {setting} --seed {seed} "
              f"--corruptions {','.join(dptta.HELD_OUT)}")
else:
    for setting, seed in itertools.product(settings, seeds):
        print(f"--method source --setting {setting} --seed {seed}")
        for m in methods:
            print(f"--method {m} --setting {setting} --seed {seed}")
            C, lr = tuned.get(f"{setting}/{m}/clip-only", dptta.PAPER_CLIP_ONLY[setting][m])
            print(f"--method {m} --clip {C} --lr {lr} --setting {setting} --seed {seed}")
            for e in epsilons:
                C, lr = tuned.get(f"{setting}/{m}/{e}", dptta.PAPER_DP[setting]["dp_" + m][e])
                print(f"--method dp_{m} --eps {e} --clip {C} --lr {lr} --setting {setting} --seed {seed}")
PY
}

mapfile -t cells < <(grid)
if [ $count = 1 ]; then echo ${#cells[@]}; exit 0; fi
if [ $dry = 1 ]; then printf 'python dptta.py %s\n' "${cells[@]}"; echo "# ${#cells[@]} cells ($stage)"; exit 0; fi
out=$OUT; [ $stage = tune ] && out=$TUNE_OUT

run() { python3 dptta.py $1 --out "$out" --resume $EXTRA; }
if [ -n "${SLURM_ARRAY_TASK_ID:-}" ]; then  # one cell per array task; the summary is yours to print
  run "${cells[$SLURM_ARRAY_TASK_ID]}"; exit 0
fi
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l); [ "$ngpu" -ge 1 ] || ngpu=1
for g in $(seq 0 $(( ngpu - 1 ))); do  # one worker per GPU, each takes every ngpu-th cell
  ( for j in $(seq "$g" "$ngpu" $(( ${#cells[@]} - 1 ))); do
      CUDA_VISIBLE_DEVICES=$g run "${cells[$j]}" || echo "cell failed: ${cells[$j]}" >&2
    done ) &
done
wait

if [ $stage = tune ]; then  # per setting, method and column: the (C, lr) with the best held-out mean
  python3 - "$TUNE_OUT" "$TUNED" <<'PY'
import json, math, sys
best = {}
for r in map(json.loads, filter(str.strip, open(sys.argv[1]))):
    if r.get("mode") != "adapt":
        continue
    m, private = r["method"].removeprefix("dp_"), r["method"].startswith("dp_")
    key = f"{r['setting']}/{m}/{int(r['eps']) if private else 'clip-only'}"
    if r["mean"] > best.get(key, (-1,))[0]:
        best[key] = (r["mean"], r["clip"], r["lr"])
json.dump({k: [c, lr] for k, (_, c, lr) in sorted(best.items())}, open(sys.argv[2], "w"), indent=1)
print(f"chose C and lr for {len(best)} cells -> {sys.argv[2]}")
PY
else
  python3 dptta.py --summarize "$out"
fi

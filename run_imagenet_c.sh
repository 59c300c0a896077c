#!/usr/bin/env bash
# Reproduce the paper's ImageNet-C tables (severity 5, ViT-B/16, batch 64) with dptta.py.
#
#   ./run_imagenet_c.sh --dry-run      print the exact commands of the grid and stop
#   ./run_imagenet_c.sh                the grid with the paper's C, lr and constants, one worker
#                                      per local GPU (one on the CPU where there is none)
#   ./run_imagenet_c.sh tune           choose C and lr on the 4 held-out corruptions -> $TUNED
#   ./run_imagenet_c.sh --tuned        the grid with the C and lr from $TUNED instead (a cell
#                                      it has none for is refused, not run at the paper's)
#   ./run_imagenet_c.sh bn             ResNet-50 with BatchNorm (resnet50.tv_in1k): source, norm,
#                                      Tent (lr 2.5e-4, its paper's) and dp_norm at ε = 20, 5, 1
#   ./run_imagenet_c.sh wild           SAR's wild settings (batch 1, mixed shifts, label shift by
#                                      class) for every method: non-private, clip-only, ε = 5
#   n=$(./run_imagenet_c.sh --count) && sbatch --array=0-$((n - 1)) --gres=gpu:1 run_imagenet_c.sh
#                                      SLURM (submit from the repo): one cell per array task
#                                      (add "tune" or "--tuned" after the script name as above)
# Environment: IMAGENET_C (data root), SEEDS ("0 1 2"), SETTINGS ("continual episodic"),
#   BATCHES ("64"; e.g. "1 16 64": the originals at that batch, the dp_ methods with
#   --accumulate so that batch x accumulate = 64),
#   METHODS ("source tent eata sar deyo deyo_come"), VARIANTS ("plain clip dp"),
#   EPSILONS ("20 15 10 5 1"), OUT (results.jsonl), TUNE_OUT (tune.jsonl), TUNED (tuned.json),
#   EXTRA (more dptta.py flags, none that a cell sets, e.g. "--limit 2000 --fisher-data DIR":
#   EATA's Fisher images, public: under --privacy-unit photo not ImageNet val, whose photos
#   ImageNet-C is made of;
#   without it every eata cell runs with no anti-forgetting penalty, and says so),
#   PYTHON (the interpreter with torch and timm; default python3, e.g. .venv/bin/python).
#   A subset, e.g. METHODS="sar deyo" VARIANTS="dp" EPSILONS="5 1" ./run_imagenet_c.sh
#   tune reads all but BATCHES (and one seed), wild SEEDS, METHODS and VARIANTS, bn SEEDS and
#   SETTINGS: a stage refuses a variable it would ignore.
# Resumable: every cell runs with --resume, so cells already in $OUT are skipped.
# The paper's constants are passed where they differ from the originals' (--hp e_margin=0.5
# for SAR, --hp plpd_threshold=0.3 for DeYO; see PAPER_CONSTANTS in dptta.py).
# Ctrl-C, SIGTERM or SIGHUP stops every worker and the cell each is running. Every cell is
#   checked as dptta.py checks it before the first one runs (its flags, folders, weights, and
#   its kind's adapter, built on a copy of its model); a cell that fails later is named, the
#   others run, and the grid exits 1 after the summary.
# Time (an estimate, not measured here): ViT-B/16 in bf16 on one H100-class GPU streams
#   roughly 1,000 images/s; a cell is 15 x 50,000 images, ~13 min. The main grid is
#   (1 source + 5 methods x 7 columns) x 2 settings = 72 cells per seed, ~16 GPU-hours per seed.
#   The tune stage is 5 x (5 x 45 + 72) x 2 = 2,970 cells on 4 corruptions: use
#   EXTRA="--limit 2000".
set -euo pipefail
set -f  # no globbing: EXTRA's and the cells' words reach dptta.py as --dry-run prints them
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")}"  # sbatch runs a spooled copy of this script
if [ ! -f dptta.py ]; then
  echo "run_imagenet_c.sh: no dptta.py in $PWD: run it, or sbatch it, from the repo" >&2; exit 2
fi
# the grid's variables the user set (a stage refuses one it does not read: never ignored)
given=
for v in SEEDS SETTINGS BATCHES METHODS VARIANTS EPSILONS; do
  if [ -n "${!v+set}" ]; then given="$given $v"; fi
done
# (set but empty: refused, never the whole grid)
SEEDS=${SEEDS-"0 1 2"}; SETTINGS=${SETTINGS-"continual episodic"}; BATCHES=${BATCHES-64}
ALL_METHODS="source tent eata sar deyo deyo_come"  # the paper's five, and the source
METHODS=${METHODS-$ALL_METHODS}; VARIANTS=${VARIANTS-"plain clip dp"}
EPSILONS=${EPSILONS-"20 15 10 5 1"}
OUT=${OUT:-results.jsonl}; TUNE_OUT=${TUNE_OUT:-tune.jsonl}; TUNED=${TUNED:-tuned.json}
EXTRA=${EXTRA:-}; PYTHON=${PYTHON:-python3}
stage=; dry=0; count=0; tuned=0
for arg in "$@"; do
  case $arg in
    --dry-run) dry=1 ;; --count) count=1 ;; --tuned) tuned=1 ;;
    tune|main|bn|wild)
      if [ -n "$stage" ]; then echo "run_imagenet_c.sh: one stage, not $stage and $arg" >&2; exit 2; fi
      stage=$arg ;;
    *) echo "run_imagenet_c.sh: unknown argument $arg (see the header)" >&2; exit 2 ;;
  esac
done
stage=${stage:-main}
if [ $tuned = 1 ] && [ $stage != main ]; then
  echo "run_imagenet_c.sh: --tuned is for the main grid, not $stage" >&2; exit 2
fi
trap 'exit 130' INT   # until the workers exist: stop after the command at hand
trap 'exit 143' TERM
trap 'exit 129' HUP   # (a dropped ssh session)
if [ $tuned = 1 ] && [ ! -f "$TUNED" ]; then
  echo "run_imagenet_c.sh: $TUNED missing: run the tune stage first" >&2; exit 2
fi
case $EXTRA in *[\"\'\\]*)  # EXTRA is split at spaces: a quote would reach dptta.py as is
  echo "run_imagenet_c.sh: EXTRA is split at spaces; quotes and backslashes cannot protect a" \
       "path with spaces: use a path (or a symlink) without spaces" >&2; exit 2 ;;
esac

# One line of dptta.py flags per cell, from dptta's own tables of the paper's values.
grid() {
  STAGE=$stage GIVEN=$given ALL_METHODS=$ALL_METHODS SEEDS=$SEEDS SETTINGS=$SETTINGS METHODS=$METHODS VARIANTS=$VARIANTS BATCHES=$BATCHES \
  EPSILONS=$EPSILONS TUNED=$([ $tuned = 1 ] && echo "$TUNED") "$PYTHON" - <<'PY'
import itertools, json, os, sys
env = {k: os.environ[k].split()
       for k in ("SEEDS", "SETTINGS", "METHODS", "VARIANTS", "EPSILONS", "BATCHES")}
stage = os.environ["STAGE"]
tuned = None  # --tuned: {"setting/method/column": [C, lr]}, the tune stage's choice
if os.environ["TUNED"]:
    try:
        tuned = json.load(open(os.environ["TUNED"]))
    except (OSError, ValueError):
        tuned = None
    pairs = isinstance(tuned, dict) and all(isinstance(v, list) and len(v) == 2
                                            for v in tuned.values())
    if not pairs:
        print(f"run_imagenet_c.sh: {os.environ['TUNED']} is not the tune stage's JSON",
              file=sys.stderr)
        sys.exit(2)
allowed = {"METHODS": tuple(os.environ["ALL_METHODS"].split()),
           "VARIANTS": ("plain", "clip", "dp"), "SETTINGS": ("continual", "episodic"),
           "BATCHES": ("1", "2", "4", "8", "16", "32", "64"),
           "EPSILONS": ("20", "15", "10", "5", "1") if stage == "main" and tuned is None
           else tuple(env["EPSILONS"])}
def is_number(v):
    try:
        return 0 < float(v) < 1e9  # (inf and nan are out)
    except ValueError:
        return False


for name, values in env.items():  # one line and exit 2, before any cell
    for v in values:
        if name == "EPSILONS" and not is_number(v):
            print(f"run_imagenet_c.sh: EPSILONS={v!r} is not a number > 0", file=sys.stderr)
            sys.exit(2)
        if (name == "SEEDS" and not v.isdigit()
                or name in allowed and v not in allowed[name]):
            print(f"run_imagenet_c.sh: {name}={v!r} is not one of "
                  f"{' '.join(allowed.get(name, ['0', '1', '...']))}", file=sys.stderr)
            sys.exit(2)
    # a cell twice (seed 0 and 00, ε 5 and 5.0 are one run): two runs releasing the same images
    numbers = name in ("SEEDS", "EPSILONS")
    distinct = {float(v) for v in values} if numbers else set(values)
    if len(distinct) < len(values):
        print(f"run_imagenet_c.sh: {name} repeats a value: {' '.join(values)}", file=sys.stderr)
        sys.exit(2)
def refuse(why):
    print(f"run_imagenet_c.sh: {why}", file=sys.stderr)
    sys.exit(2)


# what each stage reads; a variable it does not read, set by the user, would be ignored
reads = {"main": set(env), "tune": set(env) - {"BATCHES"},
         "wild": {"SEEDS", "METHODS", "VARIANTS"}, "bn": {"SEEDS", "SETTINGS"}}
runs = {"tune": "batch 64", "wild": "its own settings and batch, at ε = 5",
        "bn": "source, norm, Tent and dp_norm at ε = 20, 5, 1; batch 64"}
given = os.environ["GIVEN"].split()
for name in given:
    if name not in reads[stage]:
        refuse(f"the {stage} stage does not read {name} (it runs {runs[stage]}): unset it")
for name in given:  # set but empty: a part of the grid would go, silently
    if not env[name]:
        refuse(f"{name} is set but empty: unset it, or give it values")
if stage == "tune" and "SEEDS" in given and len(env["SEEDS"]) > 1:
    refuse("the tune stage runs one seed: SEEDS=one seed")
methods = [m for m in env["METHODS"] if m != "source"]
if "EPSILONS" in given and "dp" not in env["VARIANTS"]:
    refuse("EPSILONS is for the dp variant, which VARIANTS leaves out")
for name in ("VARIANTS", "EPSILONS", "BATCHES"):  # source has no variant, ε or window
    if name in given and not methods:
        refuse(f"{name}: METHODS has no method but source")
import dptta  # (after the checks above: a bad variable is refused without torch's seconds)


def chosen(key, paper):  # (C, lr): the paper's, or with --tuned the tune stage's, none missing
    if tuned is None:
        return paper
    if key not in tuned:  # (a failed tune cell) never the paper's value in a --tuned grid
        print(f"run_imagenet_c.sh: {os.environ['TUNED']} has no C and lr for {key}: run the "
              "tune stage for it", file=sys.stderr)
        sys.exit(2)
    return tuned[key]


epsilons = [int(e) if float(e).is_integer() else float(e) for e in env["EPSILONS"]]


def constants(m):  # the paper's scripts' filter constants, for the filtered (non-dp) runs
    return "".join(f" --hp {k}={v}" for k, v in dptta.PAPER_CONSTANTS.get(m, {}).items())


if stage == "tune":  # a grid of C and lr (the paper's DP search), held-out only
    columns = (["clip-only"] if "clip" in env["VARIANTS"] else []) + \
              (epsilons if "dp" in env["VARIANTS"] else [])
    # the paper chose C <= 10 with noise, and up to 35 for clip-only: each can be reached
    clips = {"dp": (0.1, 1, 5, 10, 15), "clip-only": (0.1, 1, 5, 10, 15, 20, 30, 35)}
    for setting, seed, m, col in itertools.product(env["SETTINGS"], env["SEEDS"][:1], methods,
                                                   columns):
        how = f"--method {m}{constants(m)}" if col == "clip-only" else f"--method dp_{m} --eps {col}"
        for C, lr in itertools.product(clips["clip-only" if col == "clip-only" else "dp"],
                                       (1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5, 1)):
            print(f"{how} --clip {C} --lr {lr} --setting {setting} --seed {seed} "
                  f"--corruptions {','.join(dptta.HELD_OUT)}")
elif stage == "wild":  # SAR's three wild settings, continual
    wild = {"batch 1": "--batch-size 1", "mixed shifts": "--setting mixed",
            "label shift": "--order class"}
    for (name, how), seed in itertools.product(wild.items(), env["SEEDS"]):
        if "source" in env["METHODS"]:
            print(f"--method source {how} --seed {seed}")
        for m in methods:
            C, lr = dptta.PAPER_CLIP_ONLY["continual"][m]
            dp = " --accumulate 64" if name == "batch 1" else ""  # one noise per 64 images
            C5, lr5, _ = dptta.paper_hparams("dp_" + m, 5)
            if "plain" in env["VARIANTS"]:
                print(f"--method {m}{constants(m)} {how} --seed {seed}")
            if "clip" in env["VARIANTS"]:
                print(f"--method {m}{constants(m)} --clip {C} --lr {lr} {how} --seed {seed}")
            if "dp" in env["VARIANTS"]:
                print(f"--method dp_{m} --eps 5 --clip {C5} --lr {lr5} {how}{dp} --seed {seed}")
elif stage == "bn":  # a BatchNorm network: its statistics, private or not
    for setting, seed in itertools.product(env["SETTINGS"], env["SEEDS"]):
        for how in ("source", "norm", "tent --lr 0.00025", "dp_norm --eps 20", "dp_norm --eps 5",
                    "dp_norm --eps 1"):
            print(f"--method {how} --model resnet50.tv_in1k --setting {setting} --seed {seed}")
else:
    for setting, seed, b in itertools.product(env["SETTINGS"], env["SEEDS"], env["BATCHES"]):
        # batch b: the originals at b, the dp_ methods at b with a step per 64 // b batches
        batch = "" if b == "64" else f" --batch-size {b}"
        dp = batch + ("" if b == "64" else f" --accumulate {64 // int(b)}")
        if "source" in env["METHODS"] and b == env["BATCHES"][-1]:  # no step: any batch
            print(f"--method source --setting {setting} --seed {seed}")
        for m in methods:
            if "plain" in env["VARIANTS"]:
                print(f"--method {m}{constants(m)}{batch} --setting {setting} --seed {seed}")
            if "clip" in env["VARIANTS"]:
                C, lr = chosen(f"{setting}/{m}/clip-only", dptta.PAPER_CLIP_ONLY[setting][m])
                print(f"--method {m}{constants(m)} --clip {C} --lr {lr}{batch} --setting "
                      f"{setting} --seed {seed}")
            for e in epsilons if "dp" in env["VARIANTS"] else []:
                paper = dptta.paper_hparams("dp_" + m, e, setting)[:2]
                C, lr = chosen(f"{setting}/{m}/{e}", paper)
                print(f"--method dp_{m} --eps {e} --clip {C} --lr {lr}{dp} --setting {setting} "
                      f"--seed {seed}")
PY
}

rc=0; cells_text=$(grid) || rc=$?
if [ $rc = 2 ]; then exit 2; fi  # a bad value, named above
if [ $rc != 0 ]; then
  echo "run_imagenet_c.sh: could not list the grid (is the environment with torch and timm" \
       "active? see the error above)" >&2
  exit 1
fi
mapfile -t cells <<< "$cells_text"
[ -n "$cells_text" ] || cells=()
if [ ${#cells[@]} = 0 ]; then
  echo "run_imagenet_c.sh: the grid is empty (METHODS, VARIANTS, EPSILONS, SEEDS, SETTINGS)" >&2
  exit 2
fi
if [ $count = 1 ]; then echo ${#cells[@]}; exit 0; fi
task=${SLURM_ARRAY_TASK_ID:-}
if [ -n "$task" ] && { ! [[ $task =~ ^[0-9]+$ ]] || [ "$task" -ge ${#cells[@]} ]; }; then
  echo "run_imagenet_c.sh: SLURM_ARRAY_TASK_ID=$task names no cell: 0 to $(( ${#cells[@]} - 1 ))" \
       "(--count)" >&2
  exit 2
fi
out=$OUT; [ $stage = tune ] && out=$TUNE_OUT
command_of() {  # the exact command of cell $1, as it runs and as --dry-run prints it
  echo "$(printf %q "$PYTHON") dptta.py ${cells[$1]} --out $(printf %q "$out") --resume${EXTRA:+ $EXTRA}"
}
ngpu=0; gpus=()
if [ -n "${CUDA_VISIBLE_DEVICES+set}" ]; then  # the GPUs this job was given, and no others:
  # as CUDA reads it, up to the first entry that names no device ("", "0,,1", "-1": none)
  IFS=, read -r -a listed <<< "$CUDA_VISIBLE_DEVICES"
  for g in "${listed[@]}"; do
    [[ $g =~ ^([0-9]+|GPU-.+|MIG-.+)$ ]] || break
    gpus+=("$g")
  done
  ngpu=${#gpus[@]}
elif command -v nvidia-smi > /dev/null 2>&1; then
  ngpu=$(nvidia-smi -L 2> /dev/null | grep -c '^GPU' || true)
  for (( g = 0; g < ngpu; g++ )); do gpus+=("$g"); done
fi
nworkers=$(( ngpu > 0 ? ngpu : 1 ))  # no GPU: one worker, dptta.py picks the CPU
workers="$nworkers worker(s) ($([ "$ngpu" -gt 0 ] && echo "$ngpu GPU(s)" || echo "no GPU: CPU"))"

# Once, before any cell: EXTRA's flags (--dry-run stops there and prints the grid), then the
# data root and the weights of every model the cells use (offline, each cell would otherwise
# spend a minute in download retries and fail)
# shellcheck disable=SC2086  # a cell and EXTRA are lists of flags: split them into words
# (the cells on file descriptor 3: the tune stage's 2,970 exceed what one variable may hold)
DRY=$dry OUT_FILE=$out "$PYTHON" - $EXTRA 3<<< "$cells_text" <<'PY' || exit 2
import contextlib, copy, gc, io, os, sys
import timm
import dptta
CELLS = open(3).read().splitlines()
# EXTRA's flags as dptta.py reads them (--seed=3, an abbreviation --se 3): none that a cell
# sets (EXTRA would override it: --batch-size 32 beside BATCHES=16's --accumulate 4)
extra = dptta.parse_args(sys.argv[1:])
grids = {"out", "resume"}
constants = set()  # the cells' --hp constants: EXTRA may add others, not set these
for cell in CELLS:
    flags = dptta.parse_args(cell.split())
    grids |= set(flags.given) - {"hp"}
    constants |= {pair.partition("=")[0] for pair in flags.hp}
for flag in sorted(grids & set(extra.given)):
    dptta.fail(f"EXTRA sets --{flag.replace('_', '-')}, which the grid sets for its cells")
for name in sorted(constants & {pair.partition("=")[0] for pair in extra.hp}):
    dptta.fail(f"EXTRA sets --hp {name}, which the grid sets for its cells")
if "noise_seed" in extra.given:  # (two cells on the same images, one noise: it cancels)
    dptta.fail("EXTRA sets --noise-seed: a grid's noise is secret")
for tool in ("summarize", "benchmark", "audit"):  # (every cell would refuse the others' flags)
    if tool in extra.given:
        dptta.fail(f"EXTRA sets --{tool}, a tool: the grid's cells are runs")
if os.environ["DRY"] == "1":  # the grid as it would run: its folders and weights unchecked
    sys.exit(0)
cells = []
for cell in CELLS:  # each checked as dptta.py checks it (quietly)
    argv = cell.split() + ["--out", os.environ["OUT_FILE"], "--resume"] + sys.argv[1:]
    with contextlib.redirect_stdout(io.StringIO()):
        cells.append(dptta.check_args(dptta.parse_args(argv)))
        dptta.fill_in_hparams(cells[-1])  # (the paper's C and lr where the cell gives none)
models, opened, built = {}, {}, set()
for cell in cells:  # its weights, its folders and Fisher images, its flags against its model
    weights = (cell.model, cell.checkpoint)
    if weights not in models:  # fetched or loaded once, or one line (smoke runs: random)
        models[weights] = dptta.build_model(cell.model, cell.checkpoint, bool(cell.synthetic))
    model, streams = models[weights], None
    if not cell.synthetic:  # (a smoke run makes its own tree)
        fisher_seed = cell.seed if cell.fisher_data else None  # (its Fisher images: its seed's)
        inputs = (cell.data, tuple(cell.corruptions), cell.severity, cell.fisher_data, fisher_seed)
        if inputs not in opened:
            with contextlib.redirect_stdout(io.StringIO()):
                opened[inputs] = dptta.open_inputs(cell)[0]
        streams = opened[inputs]
    config = timm.data.resolve_data_config({}, model=model)
    dptta.check_fits(cell, model, config, streams)
    # its adapter, on a copy of the model: once per kind of cell (C and lr: checked above)
    kind = (weights, cell.method, cell.eps, cell.delta, cell.bn, cell.clip is None, str(cell.hp),
            cell.accumulate, cell.repeat, cell.privacy_unit, cell.setting, len(cell.corruptions))
    if kind not in built:
        built.add(kind)
        dptta.make_adapter(cell, copy.deepcopy(model), config)
        gc.collect()  # (the copy goes with the adapter)
PY

if [ $dry = 1 ]; then
  for j in "${!cells[@]}"; do command_of "$j"; done
  echo "# ${#cells[@]} cells ($stage) on $workers"
  exit 0
fi

# shellcheck disable=SC2086
if [ -n "$task" ]; then  # one cell per array task; the summary is yours
  exec "$PYTHON" dptta.py ${cells[$task]} --out "$out" --resume $EXTRA
fi
# One grid per $out: a second one would run its cells again, releasing their images twice.
# The lock is held by the open file, so by every worker and cell, and ends with the last.
if command -v flock > /dev/null 2>&1; then
  exec 9>> "$out"
  if ! flock -n 9; then
    echo "run_imagenet_c.sh: another grid is running on $out: wait for it, or set OUT" >&2; exit 2
  fi
fi
echo "run_imagenet_c.sh: ${#cells[@]} cells ($stage) on $workers -> $out"

worker() {  # worker g runs every nworkers-th cell; a signal stops it and its running cell
  local g=$1 child= rc j failed=0
  trap '[ -n "$child" ] && kill -TERM "$child" 2> /dev/null; wait; exit 143' TERM INT HUP
  for (( j = g; j < ${#cells[@]}; j += nworkers )); do
    if [ "$ngpu" -gt 0 ]; then export CUDA_VISIBLE_DEVICES=${gpus[$g]}; fi
    "$PYTHON" dptta.py ${cells[$j]} --out "$out" --resume $EXTRA &  # as command_of prints it
    child=$!
    rc=0; wait "$child" || rc=$?
    child=
    if [ $rc != 0 ]; then  # (a cell killed alone, 143 or 137, too: the grid goes on)
      echo "run_imagenet_c.sh: cell failed (exit $rc): $(command_of "$j")" >&2
      failed=$(( failed + 1 ))
    fi
  done
  exit $(( failed > 0 ))
}
pids=()
stop() {
  trap - INT TERM HUP
  echo "run_imagenet_c.sh: stopping ${#pids[@]} worker(s)" >&2
  [ ${#pids[@]} = 0 ] || kill -TERM "${pids[@]}" 2> /dev/null || true
  wait
  exit "$1"
}
trap 'stop 130' INT  # before the first worker: none is left behind
trap 'stop 143' TERM
trap 'stop 129' HUP
for (( g = 0; g < nworkers; g++ )); do
  worker "$g" &
  pids+=($!)
done
failed=0
for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
trap - INT TERM HUP

if [ $stage = tune ]; then  # per setting, method and column: the (C, lr) with the best mean
  # shellcheck disable=SC2086
  OUT_FILE=$out "$PYTHON" - "$TUNE_OUT" "$TUNED" $EXTRA 3<<< "$cells_text" <<'PY'
import contextlib, io, json, os, sys
import dptta
CELLS = open(3).read().splitlines()  # (as the check before the first cell reads them)
# this grid's cells' run keys: a record of another run in TUNE_OUT (another model, --limit,
# batch, the test stream's corruptions) is never chosen from
keys = set()
for cell in CELLS:
    argv = cell.split() + ["--out", os.environ["OUT_FILE"], "--resume"] + sys.argv[3:]
    with contextlib.redirect_stdout(io.StringIO()):  # (as main keys a run)
        args = dptta.check_args(dptta.parse_args(argv))
        dptta.fill_in_hparams(args)
        keys.add(json.dumps(dptta.run_key(args), sort_keys=True))
best = {}
for _, r in dptta.read_jsonl(sys.argv[1], "the tune stage's"):  # a damaged line: skipped
    if r.get("mode") != "adapt" or json.dumps(r.get("key"), sort_keys=True) not in keys:
        continue
    m, private = r["method"].removeprefix("dp_"), r["method"].startswith("dp_")
    key = f"{r['setting']}/{m}/{r['eps']:g}" if private else f"{r['setting']}/{m}/clip-only"
    if r["mean"] > best.get(key, (-1,))[0]:
        best[key] = (r["mean"], r["clip"], r["lr"])
json.dump({k: [c, lr] for k, (_, c, lr) in sorted(best.items())}, open(sys.argv[2], "w"), indent=1)
print(f"chose C and lr for {len(best)} cells -> {sys.argv[2]}")
PY
else
  "$PYTHON" dptta.py --summarize "$out"
fi
if [ $failed = 1 ]; then  # the summary shows what ran; the exit says that some cells did not
  echo "run_imagenet_c.sh: some cells failed (each named above): the grid is incomplete" >&2
  exit 1
fi

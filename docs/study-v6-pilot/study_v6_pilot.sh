#!/usr/bin/env bash
# Study v6's exploratory pilot (docs/study-v6-pilot-plan.md): eight arms at two lengths, seeds 40 and 41, in four
# study commands (one per tokenizer and length: a single-digit run takes 1.616x the steps for the same examples),
# then the plan's 4x runs where CE still improved from 1x to 2x (the 1-3-digit noise-free arms).
# Resumable: a finished run is not repeated. Run it in the folder of a clean clone of the plan's commit (`python -m`
# imports the working folder's package before PYTHONPATH) with the main checkout's docs/ as DOCS, e.g.
#   cd $CLONE && PYTHONPATH=$PWD bash docs/study-v6-pilot/study_v6_pilot.sh /work/main/docs
# STAGE names (1x-3digit ... 4x-3digit) run only those; JOBS (default 2) is the runs at a time.
set -euo pipefail
docs=${1:?usage: study_v6_pilot.sh DOCS_FOLDER [RUNS_FOLDER [STAGE...]]}
runs=${2:-runs/study-v6-pilot}
shift $(($# < 2 ? $# : 2))
only=" $* "
recipes=$(cd "$(dirname "$0")/../.." && pwd)/recipes/study  # this script lives in docs/study-v6-pilot/
chunked="regression/ce regression/ntl-was-answer regression-exact/ce regression-exact/ntl-was-answer"
single="regression-1digit/ce regression-1digit/ntl-was-answer regression-exact-1digit/ce regression-exact-1digit/ntl-was-answer"

pilot() {  # NAME STEPS VARIANTS...
    local name=$1 steps=$2
    shift 2
    [[ $only == "  " || $only == *" $name "* ]] || return 0
    python -m ntl_pretrain.cli study --recipes "$recipes" --variants "$@" --seeds 40 41 --jobs "${JOBS:-2}" \
        --runs-dir "$runs/$name" --archive "$docs/study-v6-pilot/$name/runs" \
        --doc "$docs/study-v6-pilot/$name.md" --plot "$docs/study-v6-pilot/$name.png" \
        --title "Study v6 pilot, $name: $steps steps (exploratory, no verdict)" "train.max_steps=$steps"
}

# shellcheck disable=SC2086  # the variant lists split into words
pilot 1x-3digit 1000 $chunked
pilot 2x-3digit 2000 $chunked
pilot 1x-1digit 1616 $single
pilot 2x-1digit 3232 $single
pilot 4x-3digit 4000 regression-exact/ce regression-exact/ntl-was-answer

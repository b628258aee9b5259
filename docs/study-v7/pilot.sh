#!/usr/bin/env bash
# Study v7's exploratory pilot (docs/study-v7-pilot-plan.md): stage `3digit` runs the four 1–3-digit arms on seeds
# 200 and 201; stage `more` runs the single-digit and number-level arms on seed 200. Resumable: a finished run is
# not repeated. Run it in the folder of a clean clone of the plan's commit (`python -m` imports the working folder's
# package before PYTHONPATH) with the main checkout's docs/ as DOCS, e.g.
#   cd $CLONE && PYTHONPATH=$PWD bash docs/study-v7/pilot.sh /work/main/docs /work/runs/study-v7-pilot
# STAGE names run only those; JOBS (default 2) is the runs at a time.
set -euo pipefail
docs=${1:?usage: pilot.sh DOCS_FOLDER [RUNS_FOLDER [STAGE...]]}
runs=${2:-runs/study-v7-pilot}
shift $(($# < 2 ? $# : 2))
only=" $* "
recipes=$(cd "$(dirname "$0")/../.." && pwd)/recipes/study/v7

pilot() {  # NAME "SEEDS" VARIANTS...
    local name=$1 seeds=$2
    shift 2
    [[ $only == "  " || $only == *" $name "* ]] || return 0
    # shellcheck disable=SC2086  # the seeds split into words
    python -m ntl_pretrain.cli study --recipes "$recipes" --variants "$@" --seeds $seeds --jobs "${JOBS:-2}" \
        --runs-dir "$runs/$name" --archive "$docs/study-v7-pilot/$name/runs" \
        --doc "$docs/study-v7-pilot/$name.md" --plot "$docs/study-v7-pilot/$name.png" \
        --title "Study v7 pilot, $name: each training question seen about 1.8 times (exploratory, no verdict)"
}

pilot 3digit "200 201" regression/ce regression/ntl-was-answer regression-exact/ce regression-exact/ntl-was-answer
pilot more "200" regression-1digit/ce regression-1digit/ntl-was-answer regression-exact-1digit/ce \
    regression-exact-1digit/ntl-was-answer regression/ntl-number-answer regression-exact/ntl-number-answer

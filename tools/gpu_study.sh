#!/usr/bin/env bash
# Train a study on a borrowed GPU machine whose commands are time-limited, and bring its runs home.
#
#   tools/gpu_study.sh start NOTEBOOK [blunb.study options...]
#       launches `python -m blunb.study NOTEBOOK --script ...` in a session of its own (it outlives
#       the command that started it) with its log in $BLUNB_RESULTS/<notebook>.log, and returns.
#   tools/gpu_study.sh collect STUDY_FOLDER OUT_DIR [WAIT_S] [COMPLETED]
#       waits until the study process ends, WAIT_S seconds pass, or COMPLETED runs of STUDY_FOLDER are
#       completed; then packs every completed run not packed before (checkpoints left out) into
#       OUT_DIR/runs-<time>.tgz, copies the log, and prints each run's last metrics row.
#   tools/gpu_study.sh unpack ARCHIVE... STUDY_FOLDER
#       (back here) extracts the collected runs into STUDY_FOLDER, skipping those already there byte for
#       byte, refusing before extracting anything when one there differs (a re-trained run must not
#       replace a committed one unnoticed).
#
# Why: a command that holds the runs in its own process loses them when it is cut off, and a machine
# handed back between two commands loses everything not yet fetched. Here each command fetches what
# completed, and the runs in flight go on between commands (the study runner resumes the rest later).
set -euo pipefail
# PYTHON: the interpreter with blunb importable (python3 if unset).

usage() { sed -n '2,14p' "$0" >&2; exit 2; }
[ $# -ge 1 ] || usage
mode=$1; shift
[ "$mode" = unpack ] || results=${BLUNB_RESULTS:?set BLUNB_RESULTS: where the study writes its folder}

case "$mode" in
start)
  [ $# -ge 1 ] || usage
  notebook=$1; shift
  [ -f "$notebook" ] || { echo "no notebook $notebook" >&2; exit 2; }
  log="$results/$(basename "$notebook" .ipynb).log"
  mkdir -p "$results"
  if pgrep -f "blunb.study $notebook" > /dev/null; then
    echo "a study of $notebook is already running: not starting a second" >&2; exit 2
  fi
  rc_file="$log.rc"
  rm -f "$rc_file"
  # The folder holds the committed runs copied over: a changed plan must stop, not retrain them (blunb.study).
  BLUNB_KEEP_COMPLETED=1 PYTHONUNBUFFERED=1 setsid nohup bash -c 'python=$0 rc_file=$1; shift 1; "$python" -m blunb.study "$@"; echo $? > "$rc_file"' \
    "${PYTHON:-python3}" "$rc_file" "$notebook" --script "$@" > "$log" 2>&1 < /dev/null &
  for _ in $(seq 20); do [ -f "$rc_file" ] && break; sleep 1; done
  # A parameter error stops the study within seconds: report it now, not at the first collect.
  if [ -f "$rc_file" ]; then
    rc=$(cat "$rc_file")
    [ "$rc" = 0 ] && { echo "the study of $notebook already finished (nothing left to train?), log $log"; exit 0; }
    echo "the study of $notebook exited with $rc:" >&2; tail -20 "$log" >&2; exit 1
  fi
  echo "study of $notebook running, log $log"
  ;;
collect)
  [ $# -ge 2 ] || usage
  folder=$1 out=$2 wait_s=${3:-0} target=${4:-}
  [ -d "$folder" ] || { echo "no study folder $folder" >&2; exit 1; }
  completed() { grep -l '"state": "completed"' "$folder"/*/status.json 2> /dev/null | wc -l; }
  start=$(date +%s)
  while pgrep -f "blunb.study .*--script" > /dev/null; do
    [ $(( $(date +%s) - start )) -ge "$wait_s" ] && break
    [ -n "$target" ] && [ "$(completed)" -ge "$target" ] && break
    sleep 10
  done
  if ! pgrep -f "blunb.study .*--script" > /dev/null; then
    echo "no study process is running; exit status: $(cat "$results"/*.log.rc 2> /dev/null || echo unknown)"
  fi
  packed="$folder/.packed"
  touch "$packed"
  new=()
  for status in "$folder"/*/status.json; do
    [ -e "$status" ] || continue
    run=$(basename "$(dirname "$status")")
    grep -q '"state": "completed"' "$status" && ! grep -qx "$run" "$packed" && new+=("$run")
  done
  echo "completed and not fetched before: ${new[*]:-none} ($(completed) completed in all)"
  if [ ${#new[@]} -gt 0 ]; then
    archive="$out/runs-$(date +%Y%m%d-%H%M%S).tgz" n=1
    while [ -e "$archive" ]; do archive="$out/runs-$(date +%Y%m%d-%H%M%S)-$n.tgz"; n=$((n + 1)); done  # never over one
    tar czf "$archive" --exclude=checkpoints -C "$folder" "${new[@]}"
    printf '%s\n' "${new[@]}" >> "$packed"
  fi
  cp "$results"/*.log "$out"/ 2> /dev/null || true  # the runner's progress and any traceback
  for metrics in "$folder"/*/metrics.csv; do
    [ -e "$metrics" ] || continue  # a study folder with no run yet: the unmatched glob itself
    echo "$(basename "$(dirname "$metrics")"): $(tail -1 "$metrics" | cut -c1-60)"
  done
  ;;
unpack)
  [ $# -ge 2 ] || usage
  folder=${!#}
  archives=("${@:1:$#-1}")
  staging=$(mktemp -d)
  trap 'rm -rf "$staging"' EXIT
  runs=()
  for archive in "${archives[@]}"; do
    [ -f "$archive" ] || { echo "no archive $archive" >&2; exit 2; }
    mapfile -t names < <(tar tzf "$archive" | cut -d/ -f1 | sort -u)
    runs+=("${names[@]}")
    tar xzf "$archive" -C "$staging" 2> /dev/null || true   # a run in two archives is refused below
  done
  # A run already here is fine only as the same bytes: the GPU machine packs the committed runs it was given
  # too (they were copied there). One that differs would replace committed evidence: refused.
  new=() same=() clashes=()
  for run in "${runs[@]}"; do
    if [ ! -e "$folder/$run" ]; then new+=("$run")
    elif diff -rq "$staging/$run" "$folder/$run" > /dev/null; then same+=("$run")
    else clashes+=("$run"); fi
  done
  repeated=$(printf '%s\n' "${runs[@]}" | sort | uniq -d | tr '\n' ' ')
  if [ ${#clashes[@]} -gt 0 ] || [ -n "$repeated" ]; then
    [ ${#clashes[@]} -gt 0 ] && echo "already in $folder, different: ${clashes[*]} (remove them first to replace them)" >&2
    [ -n "$repeated" ] && echo "in more than one archive: $repeated" >&2
    echo "nothing extracted" >&2
    exit 1
  fi
  mkdir -p "$folder"
  for run in "${new[@]}"; do mv "$staging/$run" "$folder/$run"; done
  echo "unpacked ${#new[@]} run(s) into $folder: ${new[*]:-none}; ${#same[@]} already there, identical"
  ;;
*) usage ;;
esac

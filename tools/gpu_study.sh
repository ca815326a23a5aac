#!/usr/bin/env bash
# Train a study on a borrowed GPU machine whose commands are time-limited, and bring its runs home.
#
#   tools/gpu_study.sh start NOTEBOOK [blunb.study options...]
#       launches `python -m blunb.study NOTEBOOK --script ...` in a session of its own (it outlives
#       the command that started it) with its log in $BLUNB_RESULTS/<notebook>.log, and returns.
#   tools/gpu_study.sh collect STUDY_FOLDER OUT_DIR [WAIT_S] [FINISHED] [DRAIN_AFTER_S]
#       waits until the study process ends, WAIT_S seconds pass, or FINISHED runs of STUDY_FOLDER are
#       finished (completed or diverged, nested study folders included); after DRAIN_AFTER_S seconds of that
#       wait it drains the study (as drain below), so that a lease's last command ends with the runs it lets
#       finish rather than cutting off runs it started too late; then packs every finished run not
#       packed before (checkpoints left out) into OUT_DIR/runs-<time>[-n].tgz, each at most 15 MiB of run
#       files and 56 MiB in all (what a command may bring back: the rest waits for the next collect),
#       copies the log, and prints each run's last metrics row.
#   tools/gpu_study.sh drain
#       the studies under $BLUNB_RESULTS start no more runs (blunb.study.DRAIN_FILE there); those running
#       finish, and the study process then exits, naming the runs it did not start. start lifts it.
#   tools/gpu_study.sh unpack ARCHIVE... STUDY_FOLDER
#       (back here) extracts the collected runs into STUDY_FOLDER, skipping those already there byte for
#       byte, refusing before extracting anything when one there differs (a re-trained run must not
#       replace a committed one unnoticed), when an archive is damaged (cut short), or when a run in it
#       lacks status.json, config.json, env.json or metrics.csv.
#
# Why: a command that holds the runs in its own process loses them when it is cut off, and a machine
# handed back between two commands loses everything not yet fetched. Here each command fetches what
# finished, and the runs in flight go on between commands (the study runner resumes the rest later).
# The study folders already in $BLUNB_RESULTS at the first start there are the committed runs copied from
# home: they are marked as fetched then, not packed again.
set -euo pipefail
# PYTHON: the interpreter with blunb importable (python3 if unset).

usage() { sed -n '2,23p' "$0" >&2; exit 2; }
drain_file=.drain   # blunb.study.DRAIN_FILE
# Every run folder below $1 whose status.json says completed or diverged (a final state), relative to $1.
finished_runs() {
  (cd "$1" && find . -name status.json -not -path '*/checkpoints/*' -print0 | sort -z |
    while IFS= read -r -d '' f; do
      grep -qE '"state": "(completed|diverged)"' "$f" && { d=${f%/status.json}; echo "${d#./}"; }
    done) || true
}
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
  if [ ! -e "$results/.home-runs-marked" ]; then
    for study_folder in "$results"/*/; do [ -d "$study_folder" ] && finished_runs "$study_folder" >> "$study_folder/.packed"; done
    touch "$results/.home-runs-marked"
  fi
  rc_file="$log.rc"
  rm -f "$rc_file" "$results/$drain_file"   # a drain left by an earlier command would stop this study at once
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
  folder=$1 out=$2 wait_s=${3:-0} target=${4:-} drain_after=${5:-}
  [ -d "$folder" ] || { echo "no study folder $folder" >&2; exit 1; }
  [ -d "$out" ] || { echo "no output folder $out" >&2; exit 2; }
  [[ $wait_s =~ ^[0-9]+$ ]] || { echo "WAIT_S must be whole seconds, got '$wait_s'" >&2; exit 2; }
  [ -z "$target" ] || [[ $target =~ ^[0-9]+$ ]] || { echo "FINISHED must be a number of runs, got '$target'" >&2; exit 2; }
  [ -z "$drain_after" ] || [[ $drain_after =~ ^[0-9]+$ ]] ||
    { echo "DRAIN_AFTER_S must be whole seconds, got '$drain_after'" >&2; exit 2; }
  start=$(date +%s)
  while pgrep -f "blunb.study .*--script" > /dev/null; do
    [ $(( $(date +%s) - start )) -ge "$wait_s" ] && break
    if [ -n "$drain_after" ] && [ ! -e "$results/$drain_file" ] && [ $(( $(date +%s) - start )) -ge "$drain_after" ]; then
      touch "$results/$drain_file"
      echo "drained after ${drain_after} s: no run starts from here on, those running finish"
    fi
    [ -n "$target" ] && [ "$(finished_runs "$folder" | wc -l)" -ge "$target" ] && break
    sleep 2
  done
  if ! pgrep -f "blunb.study .*--script" > /dev/null; then
    echo "no study process is running; exit status: $(cat "$results"/*.log.rc 2> /dev/null || echo unknown)"
  fi
  packed="$folder/.packed"
  touch "$packed"
  mapfile -t finished < <(finished_runs "$folder")
  mapfile -t new < <(printf '%s\n' "${finished[@]}" | grep -vxF -f "$packed" | grep . || true)
  echo "finished and not fetched before: ${new[*]:-none} (${#finished[@]} finished in all)"
  # A command brings back at most 8 files of 16 MiB, 64 MiB in all: archives of <= 15 MiB of run files (gzip
  # only shrinks them), <= 56 MiB together; a run left out is packed by the next collect.
  chunk=() chunk_kb=0 total_kb=0 left=()
  pack_chunk() {
    local archive n=1
    archive="$out/runs-$(date +%Y%m%d-%H%M%S).tgz"
    while [ -e "$archive" ]; do archive="$out/runs-$(date +%Y%m%d-%H%M%S)-$n.tgz"; n=$((n + 1)); done  # never over one
    # written under another name first: a command cut off mid-write leaves no runs-*.tgz that looks whole
    tar czf "$archive.part" --exclude=checkpoints -C "$folder" "${chunk[@]}"
    mv "$archive.part" "$archive"
    printf '%s\n' "${chunk[@]}" >> "$packed"
    chunk=() chunk_kb=0
  }
  for run in "${new[@]}"; do
    kb=$(du -sk --exclude=checkpoints "$folder/$run" | cut -f1)
    if [ $((total_kb + kb)) -gt $((56 * 1024)) ]; then left+=("$run"); continue; fi
    [ ${#chunk[@]} -gt 0 ] && [ $((chunk_kb + kb)) -gt $((15 * 1024)) ] && pack_chunk
    chunk+=("$run") chunk_kb=$((chunk_kb + kb)) total_kb=$((total_kb + kb))
  done
  [ ${#chunk[@]} -gt 0 ] && pack_chunk
  [ ${#left[@]} -gt 0 ] && echo "left for the next collect (over this one's 56 MiB): ${left[*]}"
  cp "$results"/*.log "$out"/ 2> /dev/null || true  # the runner's progress and any traceback
  while IFS= read -r -d '' metrics; do
    run=${metrics#"$folder"/}
    echo "${run%/metrics.csv}: $(tail -1 "$metrics" | cut -c1-60)"
  done < <(find "$folder" -name metrics.csv -not -path '*/checkpoints/*' -print0 | sort -z)
  ;;
drain)
  touch "$results/$drain_file"
  echo "drained: the studies under $results start no more runs; those running finish ('start' lifts it)"
  ;;
unpack)
  [ $# -ge 2 ] || usage
  folder=${!#}
  archives=("${@:1:$#-1}")
  staging=$(mktemp -d)
  trap 'rm -rf "$staging"' EXIT
  runs=() i=0
  for archive in "${archives[@]}"; do
    [ -f "$archive" ] || { echo "no archive $archive" >&2; exit 2; }
    i=$((i + 1))
    mkdir "$staging/$i"   # each archive apart: a run in two of them is refused below, not merged
    if ! tar xzf "$archive" -C "$staging/$i" 2> "$staging/error"; then
      echo "$archive is damaged (cut short?): $(head -c 300 "$staging/error" | tr '\n' ' ')" >&2
      echo "nothing extracted" >&2
      exit 1
    fi
    mapfile -t names < <(finished_runs "$staging/$i")
    for run in "${names[@]}"; do
      for file in status.json config.json env.json metrics.csv; do
        if [ ! -s "$staging/$i/$run/$file" ]; then
          echo "run $run in $archive has no $file: nothing extracted" >&2
          exit 1
        fi
      done
      runs+=("$i/$run")
    done
  done
  # A run already here is fine only as the same bytes: the GPU machine packs the committed runs it was given
  # when they were not marked as fetched. One that differs would replace committed evidence: refused.
  new=() same=() clashes=()
  for entry in "${runs[@]}"; do
    run=${entry#*/}
    if [ ! -e "$folder/$run" ]; then new+=("$entry")
    elif diff -rq "$staging/$entry" "$folder/$run" > /dev/null; then same+=("$run")
    else clashes+=("$run"); fi
  done
  repeated=$(printf '%s\n' "${runs[@]}" | cut -d/ -f2- | sort | uniq -d | tr '\n' ' ')
  if [ ${#clashes[@]} -gt 0 ] || [ -n "$repeated" ]; then
    [ ${#clashes[@]} -gt 0 ] && echo "already in $folder, different: ${clashes[*]} (remove them first to replace them)" >&2
    [ -n "$repeated" ] && echo "in more than one archive: $repeated" >&2
    echo "nothing extracted" >&2
    exit 1
  fi
  done_names=()
  for entry in "${new[@]}"; do
    run=${entry#*/}
    mkdir -p "$(dirname "$folder/$run")"
    mv "$staging/$entry" "$folder/$run"
    done_names+=("$run")
  done
  echo "unpacked ${#new[@]} run(s) into $folder: ${done_names[*]:-none}; ${#same[@]} already there, identical"
  ;;
*) usage ;;
esac

#!/usr/bin/env bash
# Ready a borrowed GPU machine (no package index, no git remote, time-limited commands) for blunb's runs.
#
#   here:   tools/device_setup.sh pack
#       writes .device/ (HEAD's commit object, its tree id and file list; torchao, model.fp8's extra, from
#       pip's index); refuses uncommitted changes to tracked files. Carry .device along.
#   there:  tools/device_setup.sh setup [SRC_DIR] [CORPUS_DIR]
#       rebuilds HEAD's commit from the copied files in SRC_DIR (default /root/src; a git checkout of that sha,
#       clean, its history left out), installs the wheels into $EXTRA_DIR (default
#       /root/blunb-extra), prepares the BPE-16384 site-packages corpus in CORPUS_DIR (default
#       /data/sp-bpe16k; "-": none, for the benchmarks on random tokens) unless it is there, and prints the
#       exports for the commands that follow.
#       EXPECT_CORPUS_SHA256: the corpus the study's earlier runs read (their env.json); another one
#       stops here, before any run could mix two corpora in one study.
#
# Why a checkout and not the copied working tree: the runs' env.json then records a clean git sha that is a
# commit of main (the copy also holds carried, ignored folders). Why the wheels outside site-packages: the
# corpus is site-packages' own code, so installing into it would change the corpus (and its sha256).
set -euo pipefail

usage() { sed -n '2,14p' "$0" >&2; exit 2; }
[ $# -ge 1 ] || usage
mode=$1; shift
PYTHON=${PYTHON:-python3}
TORCHAO=${TORCHAO:-torchao==0.18.0}   # pyproject.toml's fp8 extra

case "$mode" in
pack)
  cd "$(git rev-parse --show-toplevel)"
  if ! git diff --quiet HEAD --; then
    echo "uncommitted changes to tracked files: commit them first (the GPU machine gets HEAD)" >&2
    git diff --stat HEAD -- >&2
    exit 1
  fi
  mkdir -p .device/wheels
  # HEAD's commit object and the list of its files: the GPU machine rebuilds that very commit from the copied
  # working tree (a bundle of the whole history no longer fits the 64 MiB a command may carry)
  git cat-file commit HEAD > .device/head.commit
  echo "$(git rev-parse HEAD) $(git rev-parse 'HEAD^{tree}')" > .device/head.ids
  git ls-files -z > .device/files.z
  git ls-files -s > .device/index   # mode, blob id and path of every file: the tree, for files left home too
  git ls-files -z --stage | tr '\0' '\n' | awk '$1 == "100755" { sub(/^[^\t]*\t/, ""); print }' > .device/executables
  # the abi3 build (its C++ extensions included) any CPython >= 3.10 on Linux x86_64 takes: the one the fp8 GPU tests passed with
  ls .device/wheels/torchao-*.whl > /dev/null 2>&1 ||
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_28_x86_64 \
      --python-version 3.12 -d .device/wheels "$TORCHAO"
  echo "packed $(git rev-parse --short HEAD): $(du -sh .device | cut -f1) in .device (carry it)"
  ;;
setup)
  src=${1:-/root/src} corpus=${2:-/data/sp-bpe16k} extra=${EXTRA_DIR:-/root/blunb-extra}
  [ -f .device/head.ids ] || { echo "no .device/head.ids here: run 'tools/device_setup.sh pack' and carry .device" >&2; exit 2; }
  case "$extra" in *site-packages*|*dist-packages*)
    echo "EXTRA_DIR $extra would be read as site-packages (the corpus): choose another folder" >&2; exit 2;;
  esac
  read -r sha tree < .device/head.ids
  t_start=$SECONDS   # each phase's seconds, printed last: a lease's first command pays them before any run
  if [ "$(git -C "$src" rev-parse HEAD 2> /dev/null || true)" != "$sha" ]; then
    rm -rf "$src"
    mkdir -p "$src"
    # Committed results of other studies may be left home (a sparse checkout there: the whole tree would not fit
    # the 64 MiB a command carries); anything else missing is an error.
    left_home=$(tr '\0' '\n' < .device/files.z | while IFS= read -r f; do [ -e "$f" ] || echo "$f"; done)
    if printf '%s\n' "$left_home" | grep -v '^results/' | grep -q .; then
      echo "files of HEAD missing here (only results/ may be left home):" >&2
      printf '%s\n' "$left_home" | grep -v '^results/' | head >&2
      exit 1
    fi
    [ -z "$left_home" ] || echo "left home: $(printf '%s\n' "$left_home" | cut -d/ -f1-2 | sort -u | tr '\n' ' ')"
    present=$(mktemp)
    tr '\0' '\n' < .device/files.z | while IFS= read -r f; do [ -e "$f" ] && printf '%s\0' "$f"; done > "$present"
    tar cf - --null -T "$present" | tar xf - -C "$src"
    # a copy may not keep the executable bits, which are part of the tree
    here=$PWD
    (cd "$src" && xargs -0 chmod a-x < "$present" && tr '\n' '\0' < "$here/.device/executables" |
      xargs -0 -r chmod a+x)
    git -C "$src" init -q
    # HEAD's index from its recorded blob ids; the files left home are marked skip-worktree, and every file here
    # must match its blob (diff-files), so the checkout is HEAD's and clean
    git -C "$src" update-index --index-info < .device/index
    [ -z "$left_home" ] || printf '%s\n' "$left_home" | git -C "$src" update-index --skip-worktree --stdin
    git -C "$src" update-index -q --refresh > /dev/null || true
    if ! git -C "$src" diff-files --quiet; then
      echo "copied files differ from HEAD's (a file changed after pack?):" >&2
      git -C "$src" diff-files --name-only | head >&2
      exit 1
    fi
    (cd "$src" && tr '\0' '\n' < "$present" | git hash-object -w --stdin-paths > /dev/null)
    rm -f "$present"
    built=$(git -C "$src" write-tree --missing-ok)
    if [ "$built" != "$tree" ]; then
      echo "the copied files are not HEAD's tree ($built, expected $tree): a file changed after pack?" >&2
      exit 1
    fi
    made=$(git -C "$src" hash-object -t commit -w --stdin < .device/head.commit)
    [ "$made" = "$sha" ] || { echo "rebuilt commit $made is not $sha" >&2; exit 1; }
    git -C "$src" update-ref HEAD "$sha"
  fi
  t_checkout=$((SECONDS - t_start))
  if ls .device/wheels/*.whl > /dev/null 2>&1 && [ ! -d "$extra/torchao" ]; then
    "$PYTHON" -m pip install -q --no-deps --no-index --target "$extra" .device/wheels/*.whl
  fi
  export PYTHONPATH="$src:$extra"
  t_wheels=$((SECONDS - t_start - t_checkout))
  corpus_line="no corpus" corpus_how="none"
  if [ "$corpus" != - ]; then
    corpus_how="there already"
    if [ ! -f "$corpus/meta.json" ]; then
      corpus_how="prepared"
      (cd "$src" && "$PYTHON" -m blunb.data prepare --source site-packages --tokenizer bpe:16384 --out "$corpus" \
        --no-progress > /dev/null)
    fi
    corpus_sha=$("$PYTHON" -c "import json, sys; print(json.load(open(sys.argv[1]))['sha256'])" "$corpus/meta.json")
    if [ -n "${EXPECT_CORPUS_SHA256:-}" ] && [ "$corpus_sha" != "$EXPECT_CORPUS_SHA256" ]; then
      echo "corpus $corpus has sha256 $corpus_sha, not the expected $EXPECT_CORPUS_SHA256 (another site-packages?):" \
        "its runs would not be comparable with the earlier ones" >&2
      exit 1
    fi
    corpus_line="corpus $corpus sha256 $corpus_sha"
  fi
  echo "checkout $src at $sha (clean: $(git -C "$src" status --porcelain --untracked-files=no | wc -l) changed files)"
  echo "$corpus_line"
  echo "export PYTHONPATH=$src:$extra"
  echo "setup took $((SECONDS - t_start)) s: checkout $t_checkout, wheels $t_wheels," \
    "corpus $((SECONDS - t_start - t_checkout - t_wheels)) ($corpus_how)"
  ;;
*) usage ;;
esac

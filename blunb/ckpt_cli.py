"""blunb-ckpt: check checkpoints without loading them.

    blunb-ckpt verify PATH    PATH: a checkpoint folder (<run>/checkpoints/step_<N>) or a run folder
                              (every checkpoint in <PATH>/checkpoints, newest first)

`verify` runs blunb.checkpoint.validate on each: every file's size and sha256 against checkpoint.json,
DCP's .metadata, and the payload's step against the recorded one. It prints one line per checkpoint,
`ok: ...` or `corrupt: ...` naming the file and the problem, and exits 1 when any is corrupt, 2 when
PATH holds no checkpoint. It only reads: quarantining a corrupt checkpoint is --resume auto's job.
"""

from __future__ import annotations

import argparse
import sys

from blunb import checkpoint
from blunb.checkpoint import CheckpointError
from blunb.cli import prog_name


def verify(path) -> int:
    """Print one line per checkpoint that `path` names; the exit status (0 all ok, 1 any corrupt, 2 none)."""
    folders = checkpoint.step_folders(path)
    if not folders:
        print(f"error: no checkpoint in {path} (a step_<N> folder, or a run folder with checkpoints/)", file=sys.stderr)
        return 2
    corrupt = 0
    for folder in folders:
        try:
            meta = checkpoint.validate(folder)
        except CheckpointError as err:
            corrupt += 1
            print(f"corrupt: {err}", flush=True)
            continue
        size = sum(meta["files"].values())
        print(f"ok: {folder} (step {meta['step']}, saved at world size {meta['world_size']}, "
              f"{len(meta['files'])} files, {size / 1e9:.3f} GB, sha256 verified)", flush=True)
    return 1 if corrupt else 0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog=prog_name("blunb-ckpt", "blunb.ckpt_cli"),
                                 description="Check blunb checkpoints without loading them.")
    sub = ap.add_subparsers(dest="command", required=True)
    check = sub.add_parser("verify", help="verify every file's sha256 of a checkpoint or of every checkpoint "
                                          "of a run folder; exit 1 if any is corrupt")
    check.add_argument("path", help="a checkpoint folder (checkpoints/step_<N>) or a run folder")
    args = ap.parse_args(argv)
    sys.exit(verify(args.path))


if __name__ == "__main__":
    main()

"""Give a checkpoint written by lightning-ett 0.1's ``trainer.save_checkpoint`` the manifest it lacks.

0.1's synchronous save committed by a rename without a manifest; every loader now requires
one (:func:`lightning_ett.checkpoint.layout.require_complete`). Run this once on such a
directory that you know is complete::

    python -m lightning_ett.checkpoint.adopt /ckpt/last.ckpt
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from lightning_ett.checkpoint.layout import FORMAT, META_FILE, read_meta
from lightning_ett.durable.files import fsync_path
from lightning_ett.durable.manifest import MANIFEST_FILE, write_manifest


def adopt(path: str | Path) -> dict:
    """Checksum ``path`` as it is and write its manifest; refuses a directory that is not a 0.1 checkpoint."""
    path = Path(path)
    if (path / MANIFEST_FILE).exists():
        raise FileExistsError(f"{str(path / MANIFEST_FILE)!r} exists already: nothing to adopt.")
    for required in (META_FILE, ".metadata"):
        if not (path / required).is_file():
            raise FileNotFoundError(f"{str(path / required)!r} is missing: {str(path)!r} is not a complete 0.1 checkpoint.")
    meta = read_meta(path)  # it must at least load
    manifest = write_manifest(path, FORMAT, {"global_step": int(meta.get("global_step", 0)), "time": time.time(),
                                             "seq": 0, "adopted": True})
    fsync_path(path)
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_ett.checkpoint.adopt", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", nargs="+", help="checkpoint directories written by lightning-ett 0.1")
    args = parser.parse_args(argv)
    for path in args.checkpoint:
        try:
            manifest = adopt(path)
        except (OSError, RuntimeError) as e:
            print(f"adopt: {e}", file=sys.stderr)
            return 2
        print(f"adopt: {path}: manifest written for {len(manifest['files'])} files (step {manifest['global_step']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

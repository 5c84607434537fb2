"""`python -m runtime.kernels.build`: build the C kernels once per instruction-set level into the package
(`make install` and the Docker image's build stage run it), printing each level's build time and the level
this CPU gets; `--debug` builds the debug library (argument checks) into the cache instead; `--which` only
prints the level load() picks here. runtime/kernels/library.py says how a level is chosen at run time."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from runtime.kernels import library as native_kernels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m runtime.kernels.build", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", type=Path, help=f"output directory (default: {native_kernels.BUILD_DIR})")
    parser.add_argument(
        "--level", action="append", choices=native_kernels.LEVEL_NAMES, help="only this level (repeatable)"
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        help="build the debug library (argument checks) into the cache, for PRESCIENT_KERNEL_DEBUG=1",
    )
    parser.add_argument("--which", action="store_true", help="print the level load() picks on this CPU")
    args = parser.parse_args(argv)
    if args.which:
        print(native_kernels.chosen_level() or "pytorch")
        return 0
    try:
        if args.debug:
            native_kernels.build_debug(args.level)
        else:
            native_kernels.build(args.out, args.level)
    except native_kernels.KernelsUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

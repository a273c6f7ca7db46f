"""The ``relpos`` command line: ``train``, ``eval``, ``generate``, ``demo`` (:mod:`.commands`),
``bench`` (:mod:`.bench`), ``tour`` (:mod:`.tour`) and ``compare`` (:mod:`.compare`).

The commands load PyTorch (a second or more): this module imports them inside :func:`main`, so
Ctrl-C while they load ends with one line and status 130, as it does once they run.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["build_parser", "main"]


def main(argv: list[str] | None = None) -> int:
    """The ``relpos`` entry point: :func:`relpos.cli.commands.main` (its exit statuses)."""
    try:
        from .commands import main as run
    except KeyboardInterrupt:
        print("\nrelpos: interrupted", file=sys.stderr)
        return 130
    return run(argv)


def build_parser() -> argparse.ArgumentParser:
    """The ``relpos`` argument parser (:func:`relpos.cli.commands.build_parser`)."""
    from .commands import build_parser as build

    return build()

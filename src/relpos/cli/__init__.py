"""The ``relpos`` command line: ``train``, ``eval``, ``generate``, ``demo`` (:mod:`.commands`),
``bench`` (:mod:`.bench`), ``tour`` (:mod:`.tour`) and ``compare`` (:mod:`.compare`)."""

from .commands import build_parser, main

__all__ = ["build_parser", "main"]

"""The ``relpos`` command line: ``train``, ``eval``, ``generate``, ``demo`` (:mod:`.commands`),
``bench`` (:mod:`.bench`) and ``tour`` (:mod:`.tour`)."""

from .commands import build_parser, main

__all__ = ["build_parser", "main"]

"""argparse types of the ``relpos`` command line: each failure names what it expected and what it
got (argparse prefixes "argument --flag:")."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable

__all__ = [
    "MAX_SEED",
    "SEED",
    "SPLIT_NAMES",
    "OnOffAuto",
    "int_type",
    "positive_float",
    "split_type",
]

#: The largest ``--seed`` (torch's and numpy's seeds are 64-bit).
MAX_SEED = 2**63 - 1


#: What ``--splits`` may name.
SPLIT_NAMES = ("train", "valid", "test")


def int_type(minimum: int, maximum: int | None = None, why: str = "") -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            bound = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"
            raise argparse.ArgumentTypeError(f"expected an integer {bound}{why}, got {value}")
        return value

    parse.__name__ = "integer"
    return parse


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    # A denormal one reads as 0 once the command line flushes denormals (relpos.runtime).
    if not math.isfinite(value) or value < sys.float_info.min:
        raise argparse.ArgumentTypeError(
            f"expected a finite number > 0 (at least {sys.float_info.min:g}), got {text!r}"
        )
    return value


SEED = int_type(0, MAX_SEED)


def split_type(text: str) -> str:
    if text not in SPLIT_NAMES:
        raise argparse.ArgumentTypeError(
            f"expected a split of the run's data, one of {', '.join(SPLIT_NAMES)}; got {text!r}"
        )
    return text


#: What an :class:`OnOffAuto` flag's value may be.
_ON_OFF_AUTO: dict[str, bool | str] = {
    "on": True,
    "true": True,
    "off": False,
    "false": False,
    "auto": "auto",
}


class OnOffAuto(argparse.Action):
    """``--flag`` (on), ``--flag auto``, ``--flag on|off`` and ``--no-flag`` (off): a boolean
    that may also be ``"auto"``."""

    def __init__(self, option_strings: list[str], dest: str, **kw: object) -> None:
        name = option_strings[0]
        negative = "--no-" + name[2:]
        kw.setdefault("metavar", "{on,off,auto}")
        super().__init__([name, negative], dest, nargs="?", **kw)  # type: ignore[arg-type]

    def __call__(self, parser, namespace, value, option_string=None):
        if option_string is not None and option_string.startswith("--no-"):
            if value is not None:
                parser.error(f"argument {option_string}: takes no value, got {value!r}")
            setattr(namespace, self.dest, False)
            return
        if value is None:
            setattr(namespace, self.dest, True)
            return
        if value.lower() not in _ON_OFF_AUTO:
            parser.error(f"argument {option_string}: expected on, off or auto, got {value!r}")
        setattr(namespace, self.dest, _ON_OFF_AUTO[value.lower()])

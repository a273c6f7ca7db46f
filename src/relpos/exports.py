"""A package's public names from its registry: the scheme packages (:mod:`relpos.spec`,
:mod:`relpos.schemes`, :mod:`relpos.keras.schemes`) import every module they hold, so that each
module's registration decorator runs, and export the classes it registered. Adding a scheme is
adding its modules: no list of names restates the registry. Standard library only.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterable
from types import ModuleType
from typing import Any

__all__ = ["export_classes", "import_modules"]


def import_modules(package: str, path: Iterable[str]) -> list[ModuleType]:
    """Import every module of ``package`` (its ``__name__`` and ``__path__``) in name order, the
    private ones (``_*``) aside. A module that fails to import raises: no scheme goes missing
    silently."""
    names = sorted(info.name for info in pkgutil.iter_modules(list(path)))
    return [
        importlib.import_module(f"{package}.{name}") for name in names if not name.startswith("_")
    ]


def export_classes(namespace: dict[str, Any], classes: Iterable[type]) -> list[str]:
    """Bind each class in ``namespace`` (a package's ``globals()``) under its ``__name__``, and
    return those names, sorted (for ``__all__``). A name already bound there to another object
    (two registered classes of one name, or a class named like a module) raises ValueError."""
    exported: dict[str, type] = {}
    for cls in classes:
        name = cls.__name__
        bound = exported.get(name, namespace.get(name, cls))
        if bound is not cls:
            raise ValueError(
                f"{namespace.get('__name__')}: cannot export {cls.__module__}.{cls.__qualname__} "
                f"as {name!r}, which is already {bound!r}"
            )
        exported[name] = cls
    namespace.update(exported)
    return sorted(exported)

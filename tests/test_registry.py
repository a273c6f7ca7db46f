"""The registries: every scheme is covered by the specs, refuses another's config, and is public
wherever its kind is exported, with the names generated from the registries (issue 44)."""

import importlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import relpos
from relpos import schemes, spec
from tests.helpers import SCHEME_SPECS

ROOT = Path(__file__).resolve().parents[1]


def test_every_registered_scheme_is_covered_by_the_specs():
    assert {s["name"] for s in SCHEME_SPECS} == set(relpos.SCHEMES)


def test_a_scheme_refuses_another_schemes_config():
    """``ALiBi`` and ``LearnedALiBi`` share their config's fields, yet neither takes the other's
    config: every registered scheme refuses every other scheme's (a TypeError naming both)."""
    for name, cls in relpos.SCHEMES.items():
        for other, other_cls in relpos.SCHEMES.items():
            if other == name:
                continue
            with pytest.raises(TypeError, match=f"needs a {cls.config_class.__name__}"):
                cls(other_cls.config_class(), d_model=16, num_heads=2, causal=True)


def _public(module, classes) -> None:
    """Each class is ``module.<its name>`` and listed in ``module.__all__``."""
    for cls in classes:
        assert getattr(module, cls.__name__) is cls, (module.__name__, cls)
        assert cls.__name__ in module.__all__, (module.__name__, cls.__name__)


def _all_is_exact(module) -> None:
    """``module.__all__`` names each public name once, every one resolves, and ``import *`` binds
    exactly them."""
    assert len(set(module.__all__)) == len(module.__all__), module.__name__
    namespace: dict = {}
    exec(f"from {module.__name__} import *", namespace)
    del namespace["__builtins__"]
    assert set(namespace) == set(module.__all__), module.__name__
    for name in module.__all__:
        assert namespace[name] is getattr(module, name), (module.__name__, name)


def test_every_registered_scheme_is_a_public_name_of_its_packages():
    """The re-export lists are generated from the registries (issue 44): every registered config
    is public in ``relpos`` and ``relpos.spec``, every registered PyTorch scheme and its config in
    ``relpos`` and ``relpos.schemes``, with nothing to edit when a scheme is added."""
    configs = list(spec.CONFIGS.values())
    torch_schemes = list(relpos.SCHEMES.values())
    _public(spec, configs)
    _public(schemes, [c for s in torch_schemes for c in (s, s.config_class)])
    _public(relpos, configs + torch_schemes)
    assert set(relpos.__all__) <= set(dir(relpos))
    for module in (relpos, spec, schemes):
        _all_is_exact(module)


def test_every_registered_keras_scheme_is_a_public_name_of_keras_schemes():
    """Likewise ``relpos.keras.schemes`` for the Keras schemes; in a child with Keras's NumPy
    backend, the lightest, as this suite may run without a Keras backend imported."""
    code = textwrap.dedent(
        """
        from relpos.keras import schemes

        namespace = {}
        exec("from relpos.keras.schemes import *", namespace)
        for name, cls in schemes.KERAS_SCHEMES.items():
            assert getattr(schemes, cls.__name__) is cls, name
            assert namespace[cls.__name__] is cls, name
        assert len(set(schemes.__all__)) == len(schemes.__all__)
        assert set(namespace) - {"__builtins__"} == set(schemes.__all__)
        print(*sorted(schemes.KERAS_SCHEMES))
        """
    )
    env = {**os.environ, "KERAS_BACKEND": "numpy"}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert set(result.stdout.split()) == set(relpos.SCHEMES) - set(spec.ABSOLUTE_SCHEMES)


TOY_BASE = """
REGISTRY = {}


def register(cls):
    REGISTRY[cls.__name__.lower()] = cls
    return cls
"""
TOY_INIT = """
from relpos.exports import export_classes, import_modules

from .base import REGISTRY

import_modules(__name__, __path__)
__all__ = ["REGISTRY"]
__all__ += export_classes(globals(), REGISTRY.values())
"""


def _toy_package(root: Path, name: str, modules: dict[str, str]) -> None:
    package = root / name
    package.mkdir()
    (package / "__init__.py").write_text(TOY_INIT)
    (package / "base.py").write_text(TOY_BASE)
    for module, source in modules.items():
        (package / f"{module}.py").write_text(source)


def test_a_scheme_module_added_to_a_package_is_exported(tmp_path, monkeypatch):
    """``relpos.exports``: a package exports what its modules register, the modules found by
    listing it; a class named like another bound name, or a module that fails, raises."""
    register = "from .base import register\n\n\n@register\nclass {}:\n    pass\n"
    monkeypatch.syspath_prepend(str(tmp_path))
    _toy_package(
        tmp_path, "toy_ok", {"b_const": register.format("ConstBias"), "a": register.format("A")}
    )
    toy = importlib.import_module("toy_ok")
    assert toy.__all__ == ["REGISTRY", "A", "ConstBias"]
    assert toy.ConstBias is toy.REGISTRY["constbias"]
    _toy_package(tmp_path, "toy_clash", {"a": register.format("base")})  # a module's name
    with pytest.raises(ValueError, match=r"cannot export toy_clash\.a\.base as 'base'"):
        importlib.import_module("toy_clash")
    _toy_package(tmp_path, "toy_broken", {"a": "import no_such_module_here\n"})
    with pytest.raises(ModuleNotFoundError, match="no_such_module_here"):
        importlib.import_module("toy_broken")

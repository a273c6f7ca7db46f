"""The framework-neutral base of every scheme: its config, every check, one registry of configs.

A scheme's hyper-parameters live in a frozen :class:`SchemeConfig` dataclass that validates itself
when built (:meth:`SchemeConfig.validate`: the fields alone) and validates the attention layer's
geometry when a PyTorch or Keras layer builds the scheme (:meth:`SchemeConfig.check_dims`:
``num_heads``, ``head_dim``, ``causal``). Both frameworks call the same two methods, so a spec is
accepted or refused identically, with the same message, wherever it is used.

Nothing here imports torch or keras: only the standard library and numpy.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

__all__ = [
    "ABSOLUTE_SCHEMES",
    "CONFIGS",
    "SchemeConfig",
    "check_bool",
    "check_causal",
    "check_causal_only",
    "check_config_keys",
    "check_dropout",
    "check_head_groups",
    "check_head_indices",
    "check_heads",
    "check_heads_field",
    "check_int",
    "check_positive_float",
    "check_registrable",
    "config_class",
    "config_from_dict",
    "head_mask",
    "register_config",
    "scheme_config",
]

#: Every scheme's config class by name (the names of :data:`relpos.SCHEMES`).
CONFIGS: dict[str, type[SchemeConfig]] = {}

#: Schemes that act at the input (added to token embeddings), not inside attention.
ABSOLUTE_SCHEMES = ("sinusoidal", "learned")


def check_config_keys(kind: str, cls: type, data: dict[str, Any]) -> None:
    """Raise a ``ValueError`` unless ``data`` holds only fields of the dataclass ``cls`` and every
    field without a default: a partial config names what it lacks (``kind``: ``"model config"``)
    instead of failing in ``__init__`` with a positional-argument error."""
    fields = [f for f in dataclasses.fields(cls) if f.init]
    known = sorted(f.name for f in fields)
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"unknown {kind} key(s) {unknown}; valid keys: {known}")
    missing = [
        f.name
        for f in fields
        if f.name not in data
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ValueError(
            f"{kind} needs key(s) {missing} (every other key has a default); got {sorted(data)}"
        )


def check_int(name: str, value: Any, *, minimum: int) -> None:
    """Raise a clear error unless ``value`` is an int ``>= minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def check_bool(name: str, value: Any) -> None:
    """Raise a ``TypeError`` unless ``value`` is a bool (a string such as ``"false"`` is not)."""
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} ({value!r})")


def check_causal(causal: Any) -> bool:
    """``causal`` as a bool; a string, a number or None is a ``TypeError`` (``"false"`` is
    truthy: it would run causal)."""
    check_bool("causal", causal)
    return bool(causal)


def check_causal_only(scheme: str, causal: bool) -> None:
    """Raise a ``ValueError`` naming the scheme unless ``causal``: a causal-only scheme's term is
    defined for keys at or before the query."""
    if not causal:
        raise ValueError(
            f"{scheme} needs causal=True: the scheme is causal only (its paper defines its term "
            "for keys at or before the query)"
        )


def check_positive_float(name: str, value: Any) -> None:
    """Raise a clear error unless ``value`` is a finite number ``> 0`` (NaN and inf included)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} ({value!r})")
    if not 0 < value < math.inf:
        raise ValueError(f"{name} must be a finite number > 0, got {value}")


def check_heads(d_model: Any, num_heads: Any) -> None:
    """``d_model`` and ``num_heads`` are positive ints and the heads split the width evenly."""
    check_int("num_heads", num_heads, minimum=1)  # first: the Keras layers' message for 0 heads
    check_int("d_model", d_model, minimum=1)
    if d_model % num_heads:
        raise ValueError(f"d_model ({d_model}) must be divisible by num_heads ({num_heads})")


def check_head_groups(num_heads: int, num_kv_heads: Any, *, name: str = "num_kv_heads") -> None:
    """Grouped-query attention: ``num_kv_heads`` (called ``name`` in the caller's API, e.g.
    Keras' ``num_key_value_heads``) is a positive int dividing ``num_heads``."""
    check_int(name, num_kv_heads, minimum=1)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of {name} ({num_kv_heads})")


def check_dropout(value: Any, *, name: str = "dropout") -> float:
    """A dropout rate: a number in ``[0, 1)`` (NaN and a bool refused); returned as a float."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} ({value!r})")
    if not 0.0 <= value < 1.0:  # NaN fails too
        raise ValueError(f"{name} must be in [0, 1), got {value}")
    return float(value)


def check_heads_field(heads: Any, *, field: str = "heads") -> tuple[int, ...] | None:
    """A config's ``heads``: None (every head) or a non-empty list of distinct ints ``>= 0``.

    Returns the indices as a sorted tuple (JSON gives a list), so equal selections compare equal.
    """
    if heads is None:
        return None
    if not isinstance(heads, list | tuple) or not heads:
        raise ValueError(
            f"{field} must be None (every head) or a non-empty list of head indices, got "
            f"{heads!r}; for no positional bias at all use the scheme 'nope'"
        )
    for t, h in enumerate(heads):
        if isinstance(h, bool) or not isinstance(h, int) or h < 0:
            raise ValueError(f"{field}[{t}] must be an int >= 0 (a head index), got {h!r}")
    if len(set(heads)) != len(heads):
        raise ValueError(f"{field} lists a head twice: {list(heads)}")
    return tuple(sorted(int(h) for h in heads))


def check_head_indices(
    heads: tuple[int, ...] | None, num_heads: int, *, field: str = "heads"
) -> None:
    """Raise a ``ValueError`` naming the field for a head index ``>= num_heads``."""
    bad = [h for h in heads or () if h >= num_heads]
    if bad:
        raise ValueError(
            f"{field} {list(heads)}: head {bad[0]} is out of range for num_heads={num_heads} "
            f"(valid indices 0..{num_heads - 1})"
        )


def head_mask(
    heads: tuple[int, ...] | None, num_heads: int, *, field: str = "heads"
) -> np.ndarray | None:
    """Bool ``(num_heads,)``: True for the heads that get the bias; None when all do.

    Raises:
        ValueError: an index ``>= num_heads``, naming the field, the index and ``num_heads``.
    """
    if heads is None:
        return None
    check_head_indices(heads, num_heads, field=field)
    mask = np.zeros(num_heads, dtype=bool)
    mask[list(heads)] = True
    return mask


@dataclass(frozen=True)
class SchemeConfig:
    """Base of every scheme's hyper-parameters: a frozen, validated dataclass.

    Model geometry (``num_heads``, ``head_dim``, ``causal``) is not part of it: the attention
    layer or model supplies it when the scheme is built, and :meth:`check_dims` checks it then,
    so one config serves every layer size.
    """

    name: ClassVar[str] = ""
    #: Whether the scheme exists only for causal attention (``causal=False`` is refused).
    causal_only: ClassVar[bool] = False

    def validate(self) -> None:
        """Raise ``ValueError``/``TypeError`` for impossible field values (subclasses extend)."""

    def __post_init__(self) -> None:
        self.validate()

    def check_dims(self, *, num_heads: Any, head_dim: Any, causal: Any) -> None:
        """Raise ``ValueError``/``TypeError`` unless the scheme can run in attention of this
        geometry: ``num_heads`` and ``head_dim`` positive ints, ``causal`` a bool, a causal-only
        scheme causal, and the scheme's own checks (:meth:`validate_dims`)."""
        check_int("num_heads", num_heads, minimum=1)
        check_int("head_dim", head_dim, minimum=1)
        causal = check_causal(causal)
        if self.causal_only:
            check_causal_only(self.name, causal)
        self.validate_dims(num_heads=int(num_heads), head_dim=int(head_dim), causal=causal)

    def validate_dims(self, *, num_heads: int, head_dim: int, causal: bool) -> None:
        """The scheme's checks that need the attention's geometry (subclasses extend); the
        arguments are already checked by :meth:`check_dims`."""
        check_head_indices(getattr(self, "heads", None), num_heads)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SchemeConfig:
        return config_from_dict(data)


def check_registrable(registry: dict[str, type], name: str, cls: type, *, kind: str, owner: str):
    """Raise a ``ValueError`` unless ``cls`` may be registered in ``registry`` under ``name``: a
    name is required (``owner`` must define one), and a name holds one class (a second one, say
    from a copied scheme file, would replace the first silently). Every registry of schemes
    (configs, PyTorch and Keras schemes) checks with it; ``kind`` names the registry's names."""
    if not name:
        raise ValueError(f"{owner} must define a name")
    if name in registry and registry[name] is not cls:
        raise ValueError(f"{kind} {name!r} is already registered to {registry[name].__name__}")


def register_config(cls: type[SchemeConfig]) -> type[SchemeConfig]:
    """Class decorator: register a config class under its ``name``."""
    check_registrable(CONFIGS, cls.name, cls, kind="config name", owner=cls.__name__)
    CONFIGS[cls.name] = cls
    return cls


def config_class(name: Any) -> type[SchemeConfig]:
    """The config class registered under ``name``; a clear error for an unknown one."""
    if not isinstance(name, str):
        raise TypeError(f"scheme name must be a str, got {type(name).__name__}")
    if name not in CONFIGS:
        raise ValueError(f"unknown scheme {name!r}; registered schemes: {sorted(CONFIGS)}")
    return CONFIGS[name]


def config_from_dict(data: dict[str, Any]) -> SchemeConfig:
    """Build a scheme config from ``{"name": ..., **fields}``; unknown keys are an error."""
    if not isinstance(data, dict):
        raise TypeError(f"scheme config must be a dict, got {type(data).__name__}")
    if "name" not in data:
        raise ValueError(f"scheme config needs a 'name' key, got keys {sorted(data)}")
    fields = dict(data)
    cls = config_class(fields.pop("name"))
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(
            f"unknown key(s) {unknown} for scheme {cls.name!r}; valid keys: {sorted(known)}"
        )
    return cls(**fields)


def scheme_config(spec: str | dict[str, Any] | SchemeConfig | None) -> SchemeConfig:
    """The config of a scheme given by name, config dict or config; ``None`` means ``"nope"``.

    Shared by :func:`relpos.make_scheme` and the Keras schemes, so a spec means the same in both.
    """
    if spec is None:
        spec = "nope"
    if isinstance(spec, str):
        return config_class(spec)()
    if isinstance(spec, dict):
        return config_from_dict(spec)
    if isinstance(spec, SchemeConfig):
        return spec
    raise TypeError(
        f"scheme must be a name, a config dict or a SchemeConfig, got {type(spec).__name__}"
    )

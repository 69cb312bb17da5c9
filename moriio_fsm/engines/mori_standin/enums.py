"""mori's enums as pybind11 binds a C++ ``enum class``: members are singletons, but a value that comes back from a
native call, or ``Enum(int)``, is a new object equal to its member and not identical to it.

Rules: equality holds only between two values of the same enum (``StatusCode.SUCCESS == 0`` is False); there is
no ordering; ``int()`` and ``__index__`` give the value; instances take no new attributes.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from .binding import UINT32, NoMatch

__all__ = ["PybindEnum", "make_enum"]


class PybindEnum:
    """The base of every stand-in enum; a subclass is made by ``make_enum``."""

    __slots__ = ("_value",)
    _names: dict[int, str] = {}
    _members: dict[str, PybindEnum] = {}

    def __init__(self, value: Any) -> None:
        try:
            self._value = UINT32.load(value)
        except NoMatch:
            raise TypeError(
                f"__init__(): incompatible constructor arguments. The following argument types are "
                f"supported:\n    1. mori.cpp.{type(self).__name__}(value: int)\n\n"
                f"Invoked with: {value!r}"
            ) from None

    @classmethod
    def fresh(cls, value: int) -> PybindEnum:
        """A new object for ``value``, as pybind11 makes for an enum a native call returns."""
        made = object.__new__(cls)
        made._value = int(value)
        return made

    @property
    def name(self) -> str:
        return self._names.get(self._value, "???")

    @property
    def value(self) -> int:
        return self._value

    def __int__(self) -> int:
        return self._value

    def __index__(self) -> int:
        return self._value

    def __hash__(self) -> int:
        return hash(self._value)

    def __eq__(self, other: object) -> bool:
        # pybind11's strict comparison for a scoped enum: another type is never equal.
        return (
            isinstance(other, PybindEnum)
            and type(other) is type(self)
            and other._value == self._value
        )

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __repr__(self) -> str:
        return f"<{type(self).__name__}.{self.name}: {self._value}>"

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"

    def __reduce__(self):
        return (type(self), (self._value,))


def make_enum(name: str, members: dict[str, int], export_to: dict[str, Any] | None = None) -> Any:
    """An enum class ``name`` with ``members`` (name -> value); ``export_to`` gets the members as module names,
    as pybind11's ``export_values()`` does."""
    kind: Any = type(name, (PybindEnum,), {"__slots__": (), "__module__": "mori.cpp"})
    kind._names = {value: member for member, value in members.items()}
    singletons = {}
    for member, value in members.items():
        singletons[member] = kind.fresh(value)
        setattr(kind, member, singletons[member])
    kind._members = singletons
    kind.__members__ = MappingProxyType(singletons)
    if export_to is not None:
        export_to.update(singletons)
    return kind

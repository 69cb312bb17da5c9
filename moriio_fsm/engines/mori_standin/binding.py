"""Argument conversion as pybind11 does it for mori's native module: every call is checked against its C++
signature before the stand-in runs it.

Rules: a wrong argument count, an unknown keyword, a value of the wrong type or outside its C++ type's range raises
``TypeError`` ("incompatible function arguments"), as pybind11 does; floats never pass as integers; only
parameters that mori binds with ``py::arg`` take keywords; nothing here knows about mori itself.
"""

from __future__ import annotations

import ctypes
import functools
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "BOOL",
    "BYTES",
    "CAPSULE",
    "INT",
    "SIZE_T",
    "STR",
    "UINT16",
    "UINT32",
    "UINT64",
    "Cpp",
    "NoMatch",
    "Param",
    "enum_of",
    "instance_of",
    "no_constructor",
    "signature",
    "vector_of",
]


class NoMatch(Exception):
    """A value that the C++ parameter type cannot take (pybind11 then reports the call as incompatible)."""


@dataclass(frozen=True)
class Cpp:
    """A C++ parameter type: how pybind11 names it in a signature, and how it loads a Python value."""

    shown: str
    load: Callable[[Any], Any]


def _integer(shown: str, low: int, high: int) -> Cpp:
    def load(value: Any) -> int:
        # pybind11's integer caster refuses floats outright, takes ints (bool is one) and any object
        # with __index__, and refuses what overflows the C++ type.
        if isinstance(value, float):
            raise NoMatch
        try:
            number = operator.index(value)
        except TypeError:
            raise NoMatch from None
        if not low <= number <= high:
            raise NoMatch
        return number

    return Cpp(shown, load)


INT = _integer("int", -(1 << 31), (1 << 31) - 1)
UINT16 = _integer("int", 0, (1 << 16) - 1)
UINT32 = _integer("int", 0, (1 << 32) - 1)
UINT64 = _integer("int", 0, (1 << 64) - 1)
SIZE_T = UINT64


def _load_bool(value: Any) -> bool:
    # With conversion allowed (pybind11's default for a lone overload) None is false and anything with
    # a numeric truth value (ints, floats) converts; strings, lists and the like do not.
    if value is True or value is False:
        return value
    if value is None:
        return False
    if isinstance(value, (int, float)) or hasattr(type(value), "__index__"):
        return bool(value)
    raise NoMatch


def _load_str(value: Any) -> str:
    # std::string takes str, and bytes as raw UTF-8.
    if isinstance(value, str):
        return value
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise NoMatch from None
    raise NoMatch


def _load_bytes(value: Any) -> bytes:
    # py::bytes: a bytes object only; bytearray and memoryview are refused.
    if isinstance(value, bytes):
        return value
    raise NoMatch


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _load_capsule(value: Any) -> int | None:
    # void*: a capsule (its pointer) or None (a null pointer).
    if value is None:
        return None
    if type(value).__name__ != "PyCapsule":
        raise NoMatch
    return int(_capsule_pointer(value, None) or 0)


BOOL = Cpp("bool", _load_bool)
STR = Cpp("str", _load_str)
BYTES = Cpp("bytes", _load_bytes)
CAPSULE = Cpp("capsule", _load_capsule)


def enum_of(kind: type) -> Cpp:
    """A mori enum parameter: only that enum's instances (never a plain int)."""

    def load(value: Any) -> Any:
        if not isinstance(value, kind):
            raise NoMatch
        return value

    return Cpp(f"mori.cpp.{kind.__name__}", load)


def instance_of(kind: type, *, pointer: bool = False) -> Cpp:
    """A bound class parameter; a pointer parameter also takes None (a null pointer)."""

    def load(value: Any) -> Any:
        if value is None and pointer:
            return None
        if not isinstance(value, kind):
            raise NoMatch
        return value

    return Cpp(f"mori.cpp.{kind.__name__}", load)


def vector_of(item: Cpp) -> Cpp:
    """std::vector<T>: any sequence but str and bytes, each element loaded as T."""

    def load(value: Any) -> list:
        if isinstance(value, (str, bytes, bytearray)) or not isinstance(value, Sequence):
            raise NoMatch
        return [item.load(element) for element in value]

    return Cpp(f"list[{item.shown}]", load)


_REQUIRED = object()


@dataclass(frozen=True)
class Param:
    """One parameter: its C++ type, its ``py::arg`` name (None: positional only, shown as argN) and default."""

    cpp: Cpp
    name: str | None = None
    default: Any = _REQUIRED

    @property
    def required(self) -> bool:
        return self.default is _REQUIRED


@dataclass(frozen=True)
class Binding:
    """What a stand-in function declares: its name, parameters and the type it returns, for messages and
    for the test that compares the wheel's calls with these declarations."""

    name: str
    params: tuple[Param, ...]
    returns: str
    method: bool

    def shown(self, owner: str) -> str:
        parts = [f"self: mori.cpp.{owner}"] if self.method else []
        for index, param in enumerate(self.params):
            text = f"{param.name or f'arg{index}'}: {param.cpp.shown}"
            parts.append(text if param.required else f"{text} = {param.default!r}")
        return f"({', '.join(parts)}) -> {self.returns}"

    def convert(self, args: tuple, kwargs: dict) -> list:
        """The loaded arguments, or ``NoMatch`` when pybind11 would find the call incompatible."""
        if len(args) > len(self.params):
            raise NoMatch
        loaded = []
        for index, param in enumerate(self.params):
            if index < len(args):
                if param.name is not None and param.name in kwargs:
                    raise NoMatch  # given twice
                loaded.append(param.cpp.load(args[index]))
            elif param.name is not None and param.name in kwargs:
                loaded.append(param.cpp.load(kwargs[param.name]))
            elif not param.required:
                loaded.append(param.default)
            else:
                raise NoMatch
        named = {param.name for param in self.params if param.name is not None}
        if set(kwargs) - named:
            raise NoMatch
        return loaded


def _incompatible(name: str, owner: str, binding: Binding, args: tuple, kwargs: dict) -> TypeError:
    what = "constructor" if name == "__init__" else "function"
    given = [repr(a) for a in args] + [
        f"kwargs: {', '.join(f'{k}={v!r}' for k, v in kwargs.items())}"
    ] * bool(kwargs)
    return TypeError(
        f"{name}(): incompatible {what} arguments. The following argument types are supported:\n"
        f"    1. {binding.shown(owner)}\n\nInvoked with: {', '.join(given)}"
    )


def signature(owner: str, *params: Param, returns: str = "None", method: bool = True):
    """Bind a stand-in function to a C++ signature: the function gets the loaded values, positionally.

    ``owner`` is the bound class's name (for messages); ``method=False`` for a static function.
    """

    def bind(function: Callable) -> Callable:
        binding = Binding(function.__name__, tuple(params), returns, method)

        if method:

            @functools.wraps(function)
            def call(self, *args, **kwargs):
                try:
                    loaded = binding.convert(args, kwargs)
                except NoMatch:
                    raise _incompatible(binding.name, owner, binding, args, kwargs) from None
                return function(self, *loaded)
        else:

            @functools.wraps(function)
            def call(*args, **kwargs):
                try:
                    loaded = binding.convert(args, kwargs)
                except NoMatch:
                    raise _incompatible(binding.name, owner, binding, args, kwargs) from None
                return function(*loaded)

        call.__binding__ = binding  # type: ignore[attr-defined]
        return call

    return bind


def no_constructor(owner: str) -> Callable:
    """``__init__`` of a class mori binds without a constructor: Python cannot make one."""

    def __init__(self, *args, **kwargs) -> None:
        raise TypeError(f"mori.cpp.{owner}: No constructor defined!")

    return __init__

"""A KV connector that records every call and answers each with an object of its own, for
checking that ``WatchConnector`` passes every call through unchanged.

Every method of vLLM's ``KVConnectorBase_V1`` (in the installed version) is overridden:
it records ``(name, args, kwargs)`` and returns a fresh ``Answer``; given ``RAISE`` as its
first argument it raises ``Refused`` instead. It also has a method the base class lacks.
"""

from __future__ import annotations

import inspect

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

RAISE = object()
SKIPPED = {"role", "has_connector_metadata", "_get_connector_metadata"}
CLASS_CALLS: list = []


class Answer:
    def __init__(self, name: str):
        self.name = name


class Refused(RuntimeError):
    pass


def base_methods() -> dict[str, str]:
    """Every method and property of the installed base class: name -> kind."""
    found = {}
    for name, value in vars(KVConnectorBase_V1).items():
        if name.startswith("__") or name in SKIPPED or name in ("_abc_impl", "_cache_hit_source"):
            continue
        if isinstance(value, classmethod):
            found[name] = "classmethod"
        elif isinstance(value, property):
            found[name] = "property"
        elif inspect.isfunction(value):
            found[name] = "method"
    return found


def _method(name: str):
    def method(self, *args, **kwargs):
        self.calls.append((name, args, kwargs))
        if args and args[0] is RAISE:
            raise Refused(name)
        answer = Answer(name)
        self.answers.append(answer)
        return answer

    return method


def _classmethod(name: str):
    def method(cls, *args, **kwargs):
        CLASS_CALLS.append((name, args, kwargs))
        return Answer(name)

    return classmethod(method)


def _property(name: str):
    return property(lambda self: Answer(name))


def _init(self, vllm_config, role, kv_cache_config=None):
    KVConnectorBase_V1.__init__(self, vllm_config, role, kv_cache_config)
    self.calls = []
    self.answers = []


_namespace = {"__init__": _init, "__module__": __name__}
for _name, _kind in base_methods().items():
    _namespace[_name] = {"method": _method, "classmethod": _classmethod, "property": _property}[
        _kind
    ](_name)
_namespace["prefer_cross_layer_blocks"] = _method("prefer_cross_layer_blocks")
EchoConnector = type("EchoConnector", (KVConnectorBase_V1,), _namespace)

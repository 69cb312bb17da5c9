"""Whether two peers' KV caches can exchange blocks byte for byte: the check the connector's handshake runs.

Rules: pure functions over a summary each side builds from its own geometry; every difference that would
make a block's bytes mean something else on the other side is refused, naming the field and both sides'
values; the number of blocks may differ (each side plans with the other's count), and the heads per block
only by the exact factor a head-sliced transfer expects (``head_ratio``), for a layout that has heads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

from moriio_fsm.layout.geometry import KVLayout, KVLayoutError, LayerGeometry

__all__ = ["KVCacheSummary", "KVIncompatibleError", "check_compatible"]

_LAYOUTS = frozenset(layout.value for layout in KVLayout)
_AXIS_ORDERS = frozenset({"NHD", "HND", "NL"})


class KVIncompatibleError(KVLayoutError):
    """Two peers' KV caches differ in a way that makes their blocks unexchangeable."""


@dataclass(frozen=True)
class KVCacheSummary:
    """What one side says about a layer's KV cache at handshake: everything a block's bytes depend on.

    ``num_kv_heads`` is None for MLA (no heads); ``head_size`` is then the latent size. On
    the wire (``to_wire``) it is a flat map of strings and non-negative integers, as the
    handshake's ``kv_format`` field carries, with ``num_kv_heads`` left out when None.
    """

    layout: str
    """``KVLayout`` value: "separated", "interleaved", "mla" or "cpu_attn"."""
    axis_order: str
    """"NHD" (tokens before heads), "HND" (heads first) or "NL" (MLA)."""
    dtype: str
    block_size: int
    """Tokens per scheduler block."""
    kernel_block_size: int
    """Tokens per physical block the attention kernel uses (block_size or a divisor of it)."""
    num_kv_heads: int | None
    head_size: int

    @classmethod
    def of(cls, geometry: LayerGeometry) -> KVCacheSummary:
        """The summary of one layer's geometry (``describe_layer``'s answer)."""
        shape = geometry.shape
        if geometry.layout is KVLayout.MLA:
            heads, head_size = None, shape[2]
        elif geometry.layout is KVLayout.CPU_ATTN:
            heads, head_size = shape[1], shape[3] // 2
        else:  # 5-D: axes 2 and 3 are tokens and heads in some order, axis 4 the head size
            heads, head_size = shape[5 - geometry.token_axis], shape[4]
        kernel_block_size = shape[geometry.token_axis]
        return cls(
            layout=geometry.layout.value,
            axis_order=geometry.axis_order,
            dtype=str(geometry.dtype).removeprefix("torch."),
            block_size=kernel_block_size * geometry.kernel_blocks_per_block,
            kernel_block_size=kernel_block_size,
            num_kv_heads=heads,
            head_size=head_size,
        )

    def to_wire(self) -> dict[str, str | int]:
        wire = {field.name: getattr(self, field.name) for field in fields(self)}
        if self.num_kv_heads is None:
            del wire["num_kv_heads"]
        return wire

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> KVCacheSummary:
        """Read a peer's summary; raises ``KVLayoutError`` naming the first field that is missing or wrong."""
        if not isinstance(wire, Mapping):
            raise KVLayoutError(f"peer KV cache summary must be a map, got {type(wire).__name__}")
        known = {field.name for field in fields(cls)}
        unknown = sorted(str(key) for key in wire if key not in known)
        if unknown:
            raise KVLayoutError(
                f"peer KV cache summary has unknown field(s) {', '.join(unknown)}; "
                f"expected only {', '.join(sorted(known))}"
            )
        values: dict[str, Any] = {}
        for name in ("layout", "axis_order", "dtype"):
            values[name] = _text(wire, name)
        for name in ("block_size", "kernel_block_size", "head_size"):
            values[name] = _count(wire, name)
        values["num_kv_heads"] = _count(wire, "num_kv_heads") if "num_kv_heads" in wire else None
        if values["layout"] not in _LAYOUTS:
            raise KVLayoutError(
                f"peer KV cache summary: layout {values['layout']!r} is none of "
                f"{', '.join(sorted(_LAYOUTS))}"
            )
        if values["axis_order"] not in _AXIS_ORDERS:
            raise KVLayoutError(
                f"peer KV cache summary: axis_order {values['axis_order']!r} is none of "
                f"{', '.join(sorted(_AXIS_ORDERS))}"
            )
        if not isinstance(getattr(torch, values["dtype"], None), torch.dtype):
            raise KVLayoutError(
                f"peer KV cache summary: dtype {values['dtype']!r} is not a torch dtype name"
            )
        if (values["num_kv_heads"] is None) != (values["layout"] == KVLayout.MLA.value):
            raise KVLayoutError(
                "peer KV cache summary: num_kv_heads must be given for every layout but mla, "
                f"and only then; got layout {values['layout']!r} and num_kv_heads "
                f"{values['num_kv_heads']!r}"
            )
        return cls(**values)


def _text(wire: Mapping[str, Any], name: str) -> str:
    value = wire.get(name)
    if not isinstance(value, str) or not value:
        raise KVLayoutError(
            f"peer KV cache summary: {name} must be a non-empty string, got {value!r}"
        )
    return value


def _count(wire: Mapping[str, Any], name: str) -> int:
    value = wire.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise KVLayoutError(
            f"peer KV cache summary: {name} must be a positive integer, got {value!r}"
        )
    return value


def check_compatible(
    local: KVCacheSummary,
    remote: KVCacheSummary,
    *,
    head_ratio: int = 1,
    layer_name: str | None = None,
) -> None:
    """Refuse two peers whose blocks cannot be copied byte for byte; silent when they can.

    With ``head_ratio`` k > 1 the remote must hold exactly k times the local heads per block
    (a P rank writing its heads into a D rank of a k times smaller TP size), everything
    else equal, and the layout must have heads (not MLA).

    Raises ``KVIncompatibleError`` naming every field that differs with both sides' values,
    e.g. ``block_size: local 128, remote 64``. ``TypeError`` when either is no summary,
    ``ValueError`` when ``head_ratio`` is not a positive integer.
    """
    for side, summary in (("local", local), ("remote", remote)):
        if not isinstance(summary, KVCacheSummary):
            raise TypeError(
                f"{side} must be a KVCacheSummary (KVCacheSummary.of / from_wire), "
                f"got {type(summary).__name__}"
            )
    if isinstance(head_ratio, bool) or not isinstance(head_ratio, int) or head_ratio < 1:
        raise ValueError(f"head_ratio must be a positive int, got {head_ratio!r}")
    differences = [
        f"{field.name}: local {getattr(local, field.name)}, remote {getattr(remote, field.name)}"
        for field in fields(KVCacheSummary)
        if field.name != "num_kv_heads"
        and getattr(local, field.name) != getattr(remote, field.name)
    ]
    differences += _head_difference(local, remote, head_ratio)
    if differences:
        where = f"layer {layer_name!r}: " if layer_name is not None else ""
        raise KVIncompatibleError(
            f"{where}the peers' KV caches differ, so their blocks cannot be exchanged: "
            + "; ".join(differences)
        )


def _head_difference(local: KVCacheSummary, remote: KVCacheSummary, head_ratio: int) -> list[str]:
    """The heads field's refusal, or nothing when the remote holds ``head_ratio`` x local's heads."""
    mine, theirs = local.num_kv_heads, remote.num_kv_heads
    if head_ratio == 1:
        return [] if mine == theirs else [f"num_kv_heads: local {mine}, remote {theirs}"]
    if mine is None or theirs is None:
        return [
            f"num_kv_heads: local {mine}, remote {theirs}, but a head-sliced transfer "
            f"(head_ratio {head_ratio}) needs heads on both sides (an MLA cache has none)"
        ]
    if theirs != mine * head_ratio:
        return [
            f"num_kv_heads: local {mine}, remote {theirs}, expected remote {mine * head_ratio} "
            f"(head_ratio {head_ratio}: the remote rank holds the heads of {head_ratio} local ranks)"
        ]
    return []

"""Guards and actions of the machines that move a layer per transfer operation (the WRITE
producer's writes, the READ consumer's reads), bound under one name by both.

In both specs ``posted``, ``settled`` and ``failed`` are layer bitmaps of the same meaning:
a layer is in flight from its post until it settles, and a torn-down one settles failed.
"""

from __future__ import annotations

from ..runtime.bindings import Bindings


def layer_in_flight(tx, ev) -> bool:
    layer = ev.layer
    return 0 <= layer < tx.max_layers and ((tx.posted & ~tx.settled) >> layer) & 1 == 1


def layer_already_settled(tx, ev) -> bool:
    layer = ev.layer
    return 0 <= layer < tx.max_layers and (tx.settled >> layer) & 1 == 1


def settle_abandoned(tx, ev, out) -> None:
    in_flight = tx.posted & ~tx.settled
    tx.settled |= in_flight
    tx.failed |= in_flight


def bind_layer_transfers(bindings: Bindings) -> None:
    """Register the shared per-layer guards and actions on one spec's bindings."""
    bindings.guard(layer_in_flight)
    bindings.guard(layer_already_settled)
    bindings.action(settle_abandoned)

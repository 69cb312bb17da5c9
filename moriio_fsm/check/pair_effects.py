"""How the world of a pair carries out the two sides' effects: blocks go back or into
quarantine, operations go in flight or get torn down, messages go into the channel.

Rules: the block ledger's (``moriio_fsm.ledger``), over both sides: blocks never go back
while an operation writing into them may be in flight, nor P's while one reading from
them may be (unless D's blocks, which it writes into, are quarantined); no operation is
posted on blocks that went back; blocks leave at most once. A breach is added to the
caller's list, never raised.
"""

from __future__ import annotations

from typing import Any

from .. import ledger
from .joint import NOT_STARTABLE, STARTABLE, Joint, layer_bits, show_bits
from .observer import Breach


class PairEffects:
    """The effects of one P and one D rank of ``mode``, carried out on a ``Joint``.

    An effect's fields are its kind's, declared by the spec and made at run time: to a
    static checker an effect here is Any.
    """

    def __init__(self, mode: str, layers: int, side_names: tuple[str, str]):
        self.layers = layers
        self.side_names = side_names
        self._op = "write" if mode == "write" else "read"
        self._hosts = [getattr(self, f"_{mode}_{side}") for side in ("p", "d")]

    def carry_out(self, joint: Joint, side: int, effect: Any, breaches: list) -> None:
        """Carry out ``effect`` of ``side``: blocks and operations here, messages and the
        hosts' part by the side's own function."""
        kind = effect.kind
        if kind in ledger.HANDBACKS:
            self._hand_back(joint, side, kind, breaches)
        elif kind == ledger.QUARANTINE:
            custody, violation = ledger.quarantine(joint.blocks(side), owner=self.side_names[side])
            self._blocks_moved(joint, side, custody, violation, breaches)
        elif kind in ("post_write", "post_read"):
            self._post(joint, effect.layer, breaches)
        elif kind in ("abandon_writes", "abandon_reads"):
            joint.teardown |= layer_bits(effect.layers) & joint.in_flight
        else:
            self._hosts[side](joint, effect)

    def _write_p(self, joint: Joint, effect: Any) -> None:
        if effect.kind == "send_write_done":
            joint.send("D", "write_done", num_writers=effect.num_writers, producer_rank=0)
        elif effect.kind == "send_write_failed":
            joint.send(
                "D",
                "write_failed",
                reason=effect.reason,
                writes_stopped=effect.writes_stopped,
                producer_rank=0,
            )

    def _write_d(self, joint: Joint, effect: Any) -> None:
        if effect.kind == "send_remote_blocks":
            joint.send(
                "P",
                "remote_blocks",
                block_ids=effect.block_ids,
                decode_rank=0,
                req_id=effect.req_id,
            )
        elif effect.kind == "send_release":
            joint.send("P", "release", consumer_tp_size=1, consumer_rank=0)

    def _read_p(self, joint: Joint, effect: Any) -> None:
        if effect.kind == "hold_for_reads":
            if joint.d_start == NOT_STARTABLE:
                joint.d_start = STARTABLE
        elif effect.kind == "send_lease_granted":
            joint.send(
                "D",
                "lease_granted",
                seq=effect.seq,
                lease_s=effect.lease_s,
                consumer_rank=effect.consumer_rank,
            )

    def _read_d(self, joint: Joint, effect: Any) -> None:
        if effect.kind == "request_handshake":
            joint.handshake = 1
        elif effect.kind == "send_heartbeat":
            joint.send("P", "heartbeat", consumer_rank=0, seq=effect.seq)
        elif effect.kind == "send_release":
            joint.send("P", "release", consumer_tp_size=1, consumer_rank=0)

    # -- the ledger --------------------------------------------------------------------

    def _post(self, joint: Joint, layer: int, breaches: list) -> None:
        for side, name in enumerate(self.side_names):
            violation = ledger.posted(
                joint.blocks(side), f"a {self._op} of layer {layer}", owner=name
            )
            if violation is not None:
                breaches.append(Breach(*violation))
        if 0 <= layer < self.layers:
            joint.in_flight |= 1 << layer

    def _hand_back(self, joint: Joint, side: int, kind: str, breaches: list) -> None:
        # P's blocks are every operation's source, D's its target; what is read from P
        # into blocks D quarantined is never used.
        touching = joint.in_flight if ledger.reaches(side == 1, joint.d_blocks) else 0
        what = f"a {self._op} {'into' if side else 'from'} its blocks"
        during = f"{what} (layer(s) {show_bits(touching)})" if touching else ""
        custody, violation = ledger.hand_back(
            joint.blocks(side), kind, during, owner=self.side_names[side]
        )
        self._blocks_moved(joint, side, custody, violation, breaches)

    @staticmethod
    def _blocks_moved(joint: Joint, side: int, custody: int, violation, breaches: list) -> None:
        joint.set_blocks(side, custody)
        if violation is not None:
            breaches.append(Breach(*violation))

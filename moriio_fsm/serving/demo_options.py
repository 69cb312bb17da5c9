"""What the demo asks for: its options, its prompts and the connector's fault settings.

Options are checked when made (a ``ValueError`` names the flag and what it expects); the
prompts are a repeatable mix drawn from the seed, so a later run can reuse answers.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .backends import check_backend

BLOCK = 128
VOCAB = 1024
#: Timeouts of a fault run: short, so that a lost message ends its transfer in seconds.
FAULT_TIMEOUTS: dict[str, Any] = {
    "transfer_timeout": 4.0,
    "defer_timeout": 8.0,
    "recv_abort_timeout": 8.0,
    # READ: a lease must outlast D's read timeout plus its margin (4 + 2 here)
    "lease_s": 10.0,
    "machine_config": {
        "read_consumer": {
            "setup_timeout_s": 8.0,
            "read_timeout_s": 4.0,
            "renew_interval_s": 2.0,
            "lease_margin_s": 2.0,
            "abandon_timeout_s": 1.0,
        }
    },
}


@dataclass
class DemoOptions:
    mode: str = "write"
    requests: int = 16
    faults: float = 0.0
    workdir: Path = Path("moriio-fsm-demo")
    seed: int = 0
    max_tokens: int = 16
    prefills: int | None = None  # default: 1, or 2 with faults (one is killed)
    failure_policy: str = "fail"
    show_progress: bool = True
    backend: str = "same_host"
    decodes: int = 1
    kill: str | None = None  # the instance killed mid-run (default with faults: P0)

    def __post_init__(self) -> None:
        if self.mode not in ("write", "read"):
            raise ValueError(f"--mode: expected write or read, got {self.mode!r}")
        self.backend = check_backend(self.backend)
        if not isinstance(self.requests, int) or not 1 <= self.requests <= 10_000:
            raise ValueError(f"--requests: expected 1 to 10000, got {self.requests!r}")
        if not 0.0 <= self.faults <= 0.5:
            raise ValueError(f"--faults: expected a rate from 0 to 0.5, got {self.faults!r}")
        if not 1 <= self.max_tokens <= 256:
            raise ValueError(f"--max-tokens: expected 1 to 256, got {self.max_tokens!r}")
        self.workdir = Path(self.workdir)
        if self.prefills is None:
            self.prefills = 2 if self.faults > 0 else 1
        if (
            isinstance(self.prefills, bool)
            or not isinstance(self.prefills, int)
            or not 1 <= self.prefills <= 8
        ):
            raise ValueError(f"--prefills: expected 1 to 8, got {self.prefills!r}")
        if self.faults > 0 and self.backend != "same_host":
            raise ValueError(
                f"--faults fails transfer-engine operations, which only the same_host engine "
                f"injects; --backend {self.backend} takes none (run the fault demo with "
                "--backend same_host)"
            )
        if self.faults > 0 and self.prefills < 2:
            raise ValueError("--faults kills one P mid-run, so it needs --prefills 2 or more")
        if (
            isinstance(self.decodes, bool)
            or not isinstance(self.decodes, int)
            or not 1 <= self.decodes <= 8
        ):
            raise ValueError(f"--decodes: expected 1 to 8, got {self.decodes!r}")
        if self.kill is None and self.faults > 0:
            self.kill = "P0"
        if self.kill is not None:
            self._check_kill(self.kill)

    def _check_kill(self, name: object) -> None:
        """The killed instance must exist and leave one of its role to serve."""
        counts = {"P": self.prefills or 1, "D": self.decodes}
        role, index = (name[:1], name[1:]) if isinstance(name, str) else ("", "")
        if role not in counts or not index.isdigit() or int(index) >= counts[role]:
            raise ValueError(
                f"--kill: expected an instance P0..P{counts['P'] - 1} or D0..D{counts['D'] - 1}, "
                f"got {name!r}"
            )
        if counts[role] < 2:
            flag = "--prefills" if role == "P" else "--decodes"
            raise ValueError(f"--kill {name} leaves no {role} to serve: it needs {flag} 2 or more")

    @property
    def disrupted(self) -> bool:
        """Faults injected or an instance killed: requests may fail, but only clearly."""
        return self.faults > 0 or self.kill is not None


@dataclass
class Prompt:
    kind: str
    tokens: list[int]
    group: int  # prompts of one group are sent at once


def make_prompts(count: int, seed: int) -> list[Prompt]:
    """A repeatable mix: shorter than a block, several blocks, a shared two-block prefix
    (a prefix-cache hit on D after its first use), and groups sent concurrently."""
    chance = random.Random(seed)
    prefix = [chance.randrange(3, VOCAB) for _ in range(2 * BLOCK)]
    prompts: list[Prompt] = []
    group = 0
    while len(prompts) < count:
        kind = ("short", "multi-block", "shared prefix", "concurrent")[group % 4]
        if kind == "concurrent":
            for _ in range(min(3, count - len(prompts))):
                prompts.append(
                    Prompt(
                        kind,
                        [chance.randrange(3, VOCAB) for _ in range(chance.randrange(150, 500))],
                        group,
                    )
                )
        else:
            if kind == "short":
                tokens = [chance.randrange(3, VOCAB) for _ in range(chance.randrange(5, BLOCK - 8))]
            elif kind == "multi-block":
                tokens = [
                    chance.randrange(3, VOCAB)
                    for _ in range(chance.randrange(2 * BLOCK, 5 * BLOCK))
                ]
            else:
                tokens = prefix + [
                    chance.randrange(3, VOCAB) for _ in range(chance.randrange(4, 60))
                ]
            prompts.append(Prompt(kind, tokens, group))
        group += 1
    return prompts


def connector_faults(rate: float, seed: int) -> dict[str, Any]:
    """The connector settings of a fault run: injection at ``rate`` (none at 0), short timeouts."""
    if rate <= 0:
        return dict(FAULT_TIMEOUTS)
    return {
        "fault_injection": {
            "fail_rate": rate / 4,
            "message_loss_rate": rate,
            "message_dup_rate": rate,
            "message_delay_rate": rate,
            "message_delay_s": 0.2,
            "seed": seed,
        },
        **FAULT_TIMEOUTS,
    }


__all__ = [
    "BLOCK",
    "FAULT_TIMEOUTS",
    "VOCAB",
    "DemoOptions",
    "Prompt",
    "connector_faults",
    "make_prompts",
]

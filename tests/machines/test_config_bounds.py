"""``check_config_bounds``: the resolved configs of machines that run together against every
bound their specs state, refused with both machines' keys, their values and the sum needed.
"""

from __future__ import annotations

import pytest

from moriio_fsm.check.pair import PAIR_CONFIGS
from moriio_fsm.machines import (
    ConfigBoundError,
    check_config_bounds,
    load_machine_spec,
    resolve_config,
)
from moriio_fsm.sim.pd import CONFIG as SIM_CONFIG

PAIRS = {"write": ("write_producer", "write_consumer"), "read": ("read_producer", "read_consumer")}


def configs(mode: str, **overrides: dict) -> dict[str, dict]:
    """The resolved configs of ``mode``'s two machines, with ``overrides`` by machine."""
    return {
        name: resolve_config(load_machine_spec(name), overrides.get(name)) for name in PAIRS[mode]
    }


@pytest.mark.parametrize("mode", PAIRS)
def test_the_shipped_defaults_keep_every_bound(mode):
    check_config_bounds(configs(mode))


def test_a_safety_timeout_within_p_s_drain_is_refused_naming_both_machines_keys():
    with pytest.raises(ConfigBoundError) as info:
        check_config_bounds(configs("write", write_consumer={"safety_timeout_s": 39.5}))
    message = str(info.value)
    assert message.startswith(
        "write_consumer's safety_timeout_s (39.5) must exceed write_producer's "
        "transfer_timeout_s (30.0) + abandon_timeout_s (10.0) = 40.0 (the bound at "
    )
    assert message.endswith(
        f"{load_machine_spec('write_consumer').path}:"
        f"{load_machine_spec('write_consumer').config['safety_timeout_s'].line})"
    )
    (broken,) = info.value.broken
    assert (broken.machine, broken.key, broken.value, broken.needed) == (
        "write_consumer",
        "safety_timeout_s",
        39.5,
        40.0,
    )


def test_a_longer_drain_of_p_breaks_the_same_bound():
    with pytest.raises(ConfigBoundError, match=r"abandon_timeout_s \(31\) = 61.0"):
        check_config_bounds(configs("write", write_producer={"abandon_timeout_s": 31}))


def test_a_lease_within_d_s_read_budget_is_refused_naming_both_machines_keys():
    with pytest.raises(
        ConfigBoundError,
        match=(
            r"^read_producer's lease_s \(6.0\) must exceed read_consumer's read_timeout_s "
            r"\(4.0\) \+ lease_margin_s \(2.0\) = 6.0 \(the bound at .*read_producer.yaml:\d+\)$"
        ),
    ):
        check_config_bounds(
            configs(
                "read",
                read_producer={"lease_s": 6.0},
                read_consumer={"read_timeout_s": 4.0, "lease_margin_s": 2.0},
            )
        )
    check_config_bounds(
        configs(
            "read",
            read_producer={"lease_s": 6.01},
            read_consumer={"read_timeout_s": 4.0, "lease_margin_s": 2.0},
        )
    )


def test_every_broken_bound_is_listed():
    with pytest.raises(ConfigBoundError) as info:
        check_config_bounds(
            {
                **configs("write", write_consumer={"safety_timeout_s": 1.0}),
                **configs("read", read_producer={"lease_s": 1.0}),
            }
        )
    assert [(b.machine, b.key) for b in info.value.broken] == [
        ("write_consumer", "safety_timeout_s"),
        ("read_producer", "lease_s"),
    ]


def test_a_bound_relating_a_machine_not_among_the_configs_is_not_checked():
    # D alone: P's config is not here, so nothing says how long P drains.
    only_d = {
        "write_consumer": configs("write", write_consumer={"safety_timeout_s": 1.0})[
            "write_consumer"
        ]
    }
    check_config_bounds(only_d)


def test_unknown_machines_and_configs_missing_a_key_are_refused_by_name():
    with pytest.raises(ValueError, match="unknown machine.*'nfs'"):
        check_config_bounds({"nfs": {}})
    partial = configs("write")
    del partial["write_producer"]["abandon_timeout_s"]
    with pytest.raises(ValueError, match="'write_producer' has no key 'abandon_timeout_s'"):
        check_config_bounds(partial)


@pytest.mark.parametrize(
    "scaled",
    [SIM_CONFIG, PAIR_CONFIGS["write"], PAIR_CONFIGS["read"]],
    ids=["sim", "pair-check-write", "pair-check-read"],
)
def test_the_scaled_down_configs_of_the_sim_and_the_pair_check_keep_the_bounds(scaled):
    check_config_bounds(
        {
            machine: resolve_config(load_machine_spec(machine), overrides)
            for machine, overrides in scaled.items()
        }
    )

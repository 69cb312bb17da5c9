"""The bounds between the machines' configs, as the connector's settings check them at start:
the configs a mode's two machines would get from ``kv_connector_extra_config`` must keep every
bound of their specs, and a broken one names the extra-config keys that set each value.
"""

from __future__ import annotations

import pytest

from moriio_fsm.vllm.settings import ConnectorConfigError, ConnectorSettings


@pytest.mark.parametrize("read_mode", [False, True])
def test_the_defaults_start_in_both_modes(read_mode):
    ConnectorSettings.from_extra_config({"read_mode": read_mode})


@pytest.mark.parametrize("transfer_timeout", [0.001, 1, 30, 1e6])
def test_upstream_s_transfer_timeout_alone_always_keeps_d_s_safety_timeout_past_p_s_drain(
    transfer_timeout,
):
    settings = ConnectorSettings.from_extra_config({"transfer_timeout": transfer_timeout})
    assert (
        settings.machine_overrides("write_consumer")["safety_timeout_s"]
        == 2 * transfer_timeout + 10.0
    )


def test_a_safety_timeout_override_within_p_s_drain_is_refused_naming_the_keys():
    # Before the bound was the spec's, this override was taken silently: D would give up on
    # blocks while a P that used the same settings could still be draining its writes.
    with pytest.raises(ConnectorConfigError) as info:
        ConnectorSettings.from_extra_config(
            {"machine_config": {"write_consumer": {"safety_timeout_s": 35}}}
        )
    message = str(info.value)
    assert message.startswith(
        "kv_connector_extra_config: write_consumer's safety_timeout_s (35) must exceed "
        "write_producer's transfer_timeout_s (30.0) + abandon_timeout_s (10.0) = 40.0"
    )
    assert (
        "write_consumer's safety_timeout_s is machine_config['write_consumer']"
        "['safety_timeout_s'], write_producer's transfer_timeout_s is 'transfer_timeout', "
        "write_producer's abandon_timeout_s is its spec's default (set by "
        "machine_config['write_producer']['abandon_timeout_s'])"
    ) in message
    ConnectorSettings.from_extra_config(
        {"machine_config": {"write_consumer": {"safety_timeout_s": 40.5}}}
    )


def test_an_abandon_timeout_that_outlasts_the_derived_safety_timeout_is_refused():
    with pytest.raises(
        ConnectorConfigError,
        match=(
            r"safety_timeout_s \(18.0\) must exceed .* = 20.0 .*"
            r"write_consumer's safety_timeout_s is 2 \* 'transfer_timeout' \+ 10, .*"
            r"abandon_timeout_s is machine_config\['write_producer'\]\['abandon_timeout_s'\]"
        ),
    ):
        ConnectorSettings.from_extra_config(
            {"transfer_timeout": 4, "machine_config": {"write_producer": {"abandon_timeout_s": 16}}}
        )


def test_a_lease_set_for_the_read_producer_machine_is_held_to_the_bound_too():
    # Before, only the top-level lease_s was checked, though this override is what P used.
    with pytest.raises(
        ConnectorConfigError,
        match=(
            r"read_producer's lease_s \(12.0\) must exceed .* = 15.0 .*"
            r"read_producer's lease_s is machine_config\['read_producer'\]\['lease_s'\]"
        ),
    ):
        ConnectorSettings.from_extra_config(
            {"read_mode": True, "machine_config": {"read_producer": {"lease_s": 12.0}}}
        )


def test_only_the_mode_s_machines_are_held_to_their_bounds():
    ConnectorSettings.from_extra_config(
        {"read_mode": True, "machine_config": {"write_consumer": {"safety_timeout_s": 1}}}
    )
    ConnectorSettings.from_extra_config({"machine_config": {"read_producer": {"lease_s": 1}}})

"""Fuzzing the spec loader: any YAML document, and any mutation of the shipped spec,
is either a valid spec or a SpecError listing problems, never another exception."""

from __future__ import annotations

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moriio_fsm.lang.errors import SpecError
from moriio_fsm.lang.loader import parse_spec
from moriio_fsm.lang.validate import validate_spec
from moriio_fsm.machines import spec_path

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.floats(allow_nan=True), st.text(max_size=8)
)
trees = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(st.text(max_size=8), st.integers(0, 3)), inner, max_size=4),
    ),
    max_leaves=20,
)
SHIPPED = yaml.safe_load(spec_path("write_producer").read_text())


def load(document) -> None:
    text = yaml.safe_dump(document, sort_keys=False)
    try:
        spec = parse_spec(text, "fuzz.yaml")
    except SpecError as exc:
        assert exc.problems and all(p.path == "fuzz.yaml" for p in exc.problems)
        return
    validate_spec(spec)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trees)
def test_any_yaml_document_is_a_spec_or_a_spec_error(document):
    load(document)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(sorted(SHIPPED)), trees)
def test_any_section_of_the_shipped_spec_replaced_by_junk_is_a_spec_error(section, junk):
    document = dict(SHIPPED)
    document[section] = junk
    load(document)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.integers(0, len(SHIPPED["transitions"]) - 1),
    st.sampled_from(
        ["event", "source", "dest", "guard", "actions", "emits", "outcome", "internal"]
    ),
    trees,
)
def test_any_transition_field_replaced_by_junk_is_a_spec_error(index, field, junk):
    document = dict(SHIPPED)
    rows = [dict(row) for row in SHIPPED["transitions"]]
    rows[index][field] = junk
    document["transitions"] = rows
    load(document)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(
        ["states", "events", "guards", "actions", "emits", "timers", "context", "config"]
    ),
    st.data(),
)
def test_any_declaration_replaced_by_junk_is_a_spec_error(section, data):
    entries = dict(SHIPPED[section])
    name = data.draw(st.sampled_from(sorted(entries)))
    entries[name] = data.draw(trees)
    document = dict(SHIPPED)
    document[section] = entries
    load(document)

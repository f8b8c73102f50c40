"""One declaration per config key: a key a spec reads is its field's (`hfjax.settings.key`), a
key no spec reads is a row of HAND_KEYS, and the key table gathers both without a key twice."""

from __future__ import annotations

import dataclasses

import pytest

from hfjax.config import keys
from hfjax.config.keys import HAND_KEYS, SPEC_SECTIONS, TRAIN_KEYS, merge_rows, register_keys
from hfjax.engine.spec import Spec
from hfjax.settings import Float, Int, key, spec_rows
from hfjax.settings.fields import CHECK


def _fields(cls, prefix):
    """(key, field) for every leaf field of a spec read at `prefix`, written without
    spec_rows, so the test does not trust the walk it checks."""
    for f in dataclasses.fields(cls):
        kind = cls.__dataclass_fields__[f.name].type
        nested = {s.__name__: s for s in _all_specs()}.get(kind)
        if nested is not None:
            yield from _fields(nested, f"{prefix}.{f.name}")
        else:
            yield f"{prefix}.{f.name}", f


def _all_specs():
    out, todo = [], list(Spec.__subclasses__())
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo.extend(cls.__subclasses__())
    return [c for c in out if c.__module__.startswith("hfjax.")]


def test_every_spec_field_is_exactly_one_row_of_the_table():
    spec_keys = []
    for cls, sections in SPEC_SECTIONS:
        for section in sections:
            for k, f in _fields(cls, section):
                assert CHECK in f.metadata, f"{cls.__name__}.{f.name} has no key(check)"
                assert TRAIN_KEYS[k] is f.metadata[CHECK], k  # the field's check, not a copy
                assert k not in HAND_KEYS, f"{k} is a spec field and a hand-written row"
                spec_keys.append(k)
    assert len(spec_keys) == len(set(spec_keys)), "a key read by two specs"
    assert len(spec_keys) > 60  # the actor's, critics', rollout's, algo's, score models'
    table = merge_rows(HAND_KEYS, SPEC_SECTIONS)  # TRAIN_KEYS less user-registered rows
    assert len(table) == len(HAND_KEYS) + len(spec_keys)
    assert set(table) <= set(TRAIN_KEYS)


def test_every_spec_read_from_the_config_has_its_sections():
    """A spec class that is neither in SPEC_SECTIONS nor nested in one (nor a base of one)
    would read keys no row checks."""
    covered = set()

    def cover(cls):
        covered.add(cls)
        covered.update(cls.__mro__)
        for f in dataclasses.fields(cls):
            nested = {s.__name__: s for s in _all_specs()}.get(f.type)
            if nested is not None:
                cover(nested)

    for cls, _ in SPEC_SECTIONS:
        cover(cls)
    assert [c.__name__ for c in _all_specs() if c not in covered] == []


def test_a_key_declared_as_a_row_and_a_spec_field_is_refused():
    with pytest.raises(ValueError, match=r"actor.clip_ratio is declared twice.*"
                                         r"ActorSpec.clip_ratio.*HAND_KEYS"):
        merge_rows({**HAND_KEYS, "actor.clip_ratio": Float(0.0)}, SPEC_SECTIONS)
    with pytest.raises(ValueError, match=r"cost_critic.cliprange_value is declared twice"):
        merge_rows({**HAND_KEYS, "cost_critic.cliprange_value": Float(0.0)}, SPEC_SECTIONS)


def test_a_key_read_by_two_specs_is_refused():
    from hfjax.workers.spec import CriticSpec

    with pytest.raises(ValueError, match=r"actor.ppo_mini_batch_size is declared twice"):
        merge_rows(HAND_KEYS, (*SPEC_SECTIONS, (CriticSpec, ("actor",))))


def test_a_spec_field_without_a_check_is_refused():
    @dataclasses.dataclass(frozen=True)
    class Half(Spec):
        ROLE = "half"
        a: int = key(Int(1))
        b: int = 0

    with pytest.raises(TypeError, match=r"Half.b declares no check"):
        spec_rows(Half, "half")


@dataclasses.dataclass(frozen=True)
class ProbeSpec(Spec):
    """A user algorithm's role, declared the way hfjax's are."""

    ROLE = "probe"
    steps: int = key(Int(1))
    scale: float = key(Float(0.0, lo_open=True))


def test_a_user_spec_registers_its_rows():
    saved, optional = dict(TRAIN_KEYS), set(keys.OPTIONAL_KEYS)
    try:
        rows = spec_rows(ProbeSpec, "probe")
        register_keys(rows)
        register_keys(rows)  # the module imported twice: the same checks, accepted
        assert TRAIN_KEYS["probe.steps"](0) == "needs an int >= 1"
        assert TRAIN_KEYS["probe.scale"](0.5) is None
        with pytest.raises(ValueError, match=r"actor.clip_ratio is already declared"):
            register_keys({"actor.clip_ratio": Float(0.0)})
    finally:
        TRAIN_KEYS.clear()
        TRAIN_KEYS.update(saved)
        keys.OPTIONAL_KEYS.clear()
        keys.OPTIONAL_KEYS.update(optional)

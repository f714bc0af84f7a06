"""Settings parsing and the register's signature rule, in-process."""

import re

import pytest
from sglang_dsv4 import settings
from sglang_dsv4.register import parameters_of


@pytest.mark.parametrize(
    "raw,expected",
    [
        (None, "fp8"),
        ("", "fp8"),
        ("bf16", "bf16"),
        (" BF16 ", "bf16"),
        ("fp4", "fp4"),
        ("fp8", "fp8"),
    ],
)
def test_index_k_dtype_values(raw, expected):
    env = {} if raw is None else {"SGLANG_DSV4_INDEX_K_DTYPE": raw}
    assert settings.from_environ(env).index_k_dtype == expected


@pytest.mark.parametrize("raw", ["int8", "bfloat16", "fp16", "e4m3"])
def test_unknown_index_k_dtype_lists_allowed_values(raw):
    with pytest.raises(settings.SettingsError) as err:
        settings.from_environ({"SGLANG_DSV4_INDEX_K_DTYPE": raw})
    assert str(err.value) == (
        f"SGLANG_DSV4_INDEX_K_DTYPE={raw!r} is not supported; allowed: fp8, bf16, fp4"
    )


def test_skip_and_allow_unpinned():
    conf = settings.from_environ(
        {
            "SGLANG_DSV4_SKIP_FIXES": "index-k-bf16, nixl-bootstrap-cascade,,",
            "SGLANG_DSV4_ALLOW_UNPINNED": "yes",
        }
    )
    assert conf.skip_fixes == {"index-k-bf16", "nixl-bootstrap-cascade"}
    assert conf.allow_unpinned
    assert not settings.from_environ({}).allow_unpinned


def test_an_unknown_fix_id_to_skip_is_refused_naming_the_known_ones():
    with pytest.raises(settings.SettingsError) as err:
        settings.from_environ({"SGLANG_DSV4_SKIP_FIXES": "index-k-bf16,bogus-id"})
    assert str(err.value) == (
        "SGLANG_DSV4_SKIP_FIXES names no fix 'bogus-id'; known: index-k-bf16, pool-sizing-bf16, "
        "index-k-transfer-gate, host-mirror-geometry, nixl-bootstrap-cascade"
    )


@pytest.mark.parametrize("raw", [None, "", "bf16", " FP4 ", "fp8", "int8", "bfloat16"])
def test_settings_accept_exactly_what_the_index_k_fix_accepts(raw):
    # Settings must not import the fix (start-up cost), so each keeps its own parse.
    from sglang_dsv4.fixes import index_k_bf16

    assert settings.INDEX_K_DTYPES == index_k_bf16.INDEX_K_DTYPES
    try:
        expected = index_k_bf16.parse_dsv4_index_k_dtype(raw)
    except ValueError as exc:
        with pytest.raises(settings.SettingsError, match=re.escape(str(exc))):
            settings.parse_index_k_dtype(raw)
    else:
        assert settings.parse_index_k_dtype(raw) == expected


def test_parameters_of_ignores_annotations_but_not_names_or_defaults():
    def a(self, layer_id: int, *, x: float = 1.0) -> int: ...
    def b(self, layer_id, *, x=1.0): ...
    def c(self, layer, *, x=1.0): ...

    assert parameters_of(a) == parameters_of(b) == "(self, layer_id, *, x=1.0)"
    assert parameters_of(c) != parameters_of(b)

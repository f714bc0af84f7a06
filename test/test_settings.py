"""Settings parsing and the register's signature rule, in-process."""

import os
import re

import pytest
from sglang_dsv4 import settings
from sglang_dsv4.fix import parameters_of


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
        "index-k-transfer-gate, host-mirror-geometry, nixl-bootstrap-cascade, "
        "nixl-control-health"
    )


@pytest.mark.parametrize(
    "raw, stored",
    [(None, "fp8"), ("", "fp8"), ("  ", "fp8"), ("bf16", "bf16"), (" FP4 ", "fp4"), ("fp8", "fp8")],
)
def test_settings_and_the_fix_read_the_index_k_dtype_by_one_rule(raw, stored):
    # One parse (sglang_dsv4.index_k_dtype), the very function index-k-bf16 adds upstream:
    # blank is the same as unset.
    from sglang_dsv4 import index_k_dtype
    from sglang_dsv4.fixes import index_k_bf16

    assert index_k_bf16.parse_dsv4_index_k_dtype is index_k_dtype.parse_dsv4_index_k_dtype
    assert settings.parse_index_k_dtype(raw) == stored
    requested = index_k_dtype.parse_dsv4_index_k_dtype(raw)
    assert (requested is None) == (not (raw or "").strip())


@pytest.mark.parametrize("raw", ["int8", "bfloat16", "fp 8"])
def test_an_index_k_dtype_nobody_stores_is_one_clear_error(raw):
    from sglang_dsv4 import index_k_dtype

    line = f"SGLANG_DSV4_INDEX_K_DTYPE={raw!r} is not supported; allowed: fp8, bf16, fp4"
    with pytest.raises(ValueError, match=re.escape(line)):
        index_k_dtype.parse_dsv4_index_k_dtype(raw)
    with pytest.raises(settings.SettingsError, match=re.escape(line)):
        settings.parse_index_k_dtype(raw)


def test_a_process_reads_the_index_k_dtype_from_its_environment_once(monkeypatch):
    # The settings and the pools share the one cached read: a later change of the variable
    # moves neither.
    from sglang_dsv4 import index_k_dtype

    monkeypatch.setenv("SGLANG_DSV4_INDEX_K_DTYPE", "bf16")
    index_k_dtype.requested_dsv4_index_k_dtype.cache_clear()
    try:
        assert settings.from_environ(os.environ).index_k_dtype == "bf16"
        monkeypatch.setenv("SGLANG_DSV4_INDEX_K_DTYPE", "fp8")
        assert index_k_dtype.requested_dsv4_index_k_dtype() == "bf16"
        assert settings.from_environ(os.environ).index_k_dtype == "bf16"
        # A mapping that is not the process's environment is read as given.
        assert settings.from_environ({"SGLANG_DSV4_INDEX_K_DTYPE": "fp8"}).index_k_dtype == "fp8"
    finally:
        index_k_dtype.requested_dsv4_index_k_dtype.cache_clear()


@pytest.mark.parametrize(
    "requested, fp4_flag, stored",
    [(None, False, "fp8"), (None, True, "fp4"), ("bf16", False, "bf16"), ("fp4", True, "fp4")],
)
def test_the_dtype_a_server_stores(requested, fp4_flag, stored):
    from sglang_dsv4.index_k_dtype import dsv4_index_k_dtype_for

    assert dsv4_index_k_dtype_for(requested, fp4_flag) == stored


@pytest.mark.parametrize(
    "requested, fp4_flag, message",
    [("fp4", False, "pass --enable-deepseek-v4-fp4-indexer"), ("bf16", True, "contradicts")],
)
def test_a_contradictory_index_k_setting_is_refused(requested, fp4_flag, message):
    from sglang_dsv4.index_k_dtype import dsv4_index_k_dtype_for

    with pytest.raises(ValueError, match=message):
        dsv4_index_k_dtype_for(requested, fp4_flag)


def test_bytes_per_token_is_one_rule_and_the_pd_pairing_table_follows_it():
    # host-mirror-geometry's PD pairing check spells the rule backwards as a literal table (its
    # patch must not depend on index-k-bf16's, which adds the rule upstream): held to it here.
    import ast
    import inspect

    from sglang_dsv4.fixes import host_mirror_geometry
    from sglang_dsv4.index_k_dtype import INDEX_K_DTYPES, dsv4_index_k_bytes_per_token

    rule = {dsv4_index_k_bytes_per_token(128, d): d for d in INDEX_K_DTYPES}
    assert rule == {132: "fp8", 256: "bf16", 68: "fp4"}
    source = inspect.getsource(host_mirror_geometry.dsv4_index_k_pairing_refusal)
    tables = [
        ast.literal_eval(node)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Dict) and node.keys and isinstance(node.keys[0], ast.Constant)
    ]
    assert tables == [rule]


def test_parameters_of_ignores_annotations_but_not_names_or_defaults():
    def a(self, layer_id: int, *, x: float = 1.0) -> int: ...
    def b(self, layer_id, *, x=1.0): ...
    def c(self, layer, *, x=1.0): ...

    assert parameters_of(a) == parameters_of(b) == "(self, layer_id, *, x=1.0)"
    assert parameters_of(c) != parameters_of(b)

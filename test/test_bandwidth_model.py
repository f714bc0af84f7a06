"""The logits step's bandwidth model (benchmark/bandwidth_model.py): the review's figures."""

from benchmark import bandwidth_model as model


def test_batch_32_at_20k_keys_is_the_reviews_figure():
    bf16 = model.bytes_per_call(32, 20_000, 64, "bf16")["total"]
    fp8 = model.bytes_per_call(32, 20_000, 64, "fp8")["total"]
    assert round(bf16 / 1e6, 1) == 167.0 and round(model.roofline_us(bf16), 1) == 92.8
    assert round(model.roofline_us(fp8), 1) == 48.5


def test_the_table_covers_the_kits_shapes(capsys):
    assert model.main([]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 + len(model.KIT_BATCHES) * len(model.KIT_KEYS)
    assert lines[0].startswith("| B | keys | bf16 MB")

"""The sweep: in every sampled cell of TP x role x index-K dtype x budget x max running requests x
MTP (page 256, the only size upstream runs DeepSeek-V4 with on CUDA), upstream's chain sizes the
pools for the budget, the real pools are built on the meta device, and they take at most the
budget while leaving less than one more page of every pool unused. Cells whose budget is below the
pools' minimum must be refused by upstream, never sized over the budget.
"""

import json

import pytest
from sglang_dsv4.cli import main
from sglang_dsv4.plan import SWEEP_AXES, sweep, sweep_cells

REFUSALS = ("cannot hold even one request", "Not enough memory")


@pytest.fixture(scope="module")
def report():
    return sweep(sample=16)


def test_every_sized_cell_fits_its_budget(report):
    sized = [cell for cell in report["cells"] if cell["refused"] is None]
    assert len(sized) > 100
    worst = report["worst_cell"]
    print(f"\nworst allocated - budget: {report['worst_over_bytes']:,} B in {worst}")
    for cell in sized:
        assert cell["over_bytes"] <= 0, cell
        assert -cell["over_bytes"] < cell["one_more_page_bytes"], cell


def test_refused_cells_are_refused_by_upstream(report):
    refused = [cell for cell in report["cells"] if cell["refused"] is not None]
    for cell in refused:
        assert any(reason in cell["refused"] for reason in REFUSALS), cell
        # Only the c128 compress state of 512+ requests (5 GiB per 512, twice that with MTP's
        # wider ring) can outgrow a budget of the grid.
        assert cell["kv_gib"] <= 20 and cell["max_running_requests"] >= 512, cell


def test_the_corners_are_always_in_the_sample():
    cells = sweep_cells(sample=3, seed=7)
    keys = {tuple(sorted(cell.items())) for cell in cells}
    for tp in (SWEEP_AXES["tp"][0], SWEEP_AXES["tp"][-1]):
        for kv_gib in (SWEEP_AXES["kv_gib"][0], SWEEP_AXES["kv_gib"][-1]):
            for dtype in SWEEP_AXES["index_k_dtype"]:
                for mode in SWEEP_AXES["disaggregation_mode"]:
                    for requests in (None, 1024):
                        for mtp in (False, True):
                            corner = dict(
                                tp=tp,
                                disaggregation_mode=mode,
                                page_size=256,
                                index_k_dtype=dtype,
                                kv_gib=kv_gib,
                                max_running_requests=requests,
                                mtp=mtp,
                            )
                            assert tuple(sorted(corner.items())) in keys
    assert len(cells) == 144 + 3


def test_sweep_command_json(capsys):
    assert main(["plan", "--sweep", "--sweep-sample", "0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["worst_over_bytes"] <= 0
    assert out["sized"] + out["refused"] == len(out["cells"]) == 144

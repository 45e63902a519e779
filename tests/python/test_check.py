"""flashref.check: the verdict and wording of `flashref check`, from the same C++ judge."""

import json

import numpy as np
import pytest

import flashref

from conftest import run_cli

h5py = pytest.importorskip("h5py")


def cli_verdict(cli, tmp_path, fx, o, lse):
    cand = tmp_path / "cand.h5"
    with h5py.File(cand, "w") as f:
        f["o"] = o
        if lse is not None:
            f["lse"] = lse
    r = run_cli(cli, "check", fx.path, "--candidate", cand, "--json", "-",
                expect=0 if flashref.check(fx, o, lse).passed else 1)
    return json.loads(r.stdout)["rows"][0]


def slips(fx):
    """Results that fail in the ways other kernels do, and the golden result that passes."""
    o, lse = fx.o.astype(np.float32), fx.lse.astype(np.float32)
    empty = np.isneginf(fx.lse)
    nan_row = o.copy()
    nan_row[0, 0, 0, 0] = np.nan
    wrong = o.copy()
    wrong[0, -1, -1, :] += 0.5
    fa2 = lse.copy()
    fa2[empty] = np.inf
    return {
        "golden": (o, lse),
        "nan": (nan_row, lse),
        "wrong": (wrong, lse),
        "base2": (o, lse / np.log(2)),
        "lse_inf_on_empty": (o, fa2),
        "half": (o.astype(np.float16), lse.astype(np.float16)),
        "no_lse": (o, None),
    }


@pytest.mark.parametrize("name", ["blocksparse_empty_rows", "causal_lq_gt_lk", "gqa",
                                  "spec_all_masked"])
def test_same_verdict_and_words_as_the_cli(cli, tmp_path, name):
    fx = flashref.fixtures.load(name)
    for what, (o, lse) in slips(fx).items():
        report = flashref.check(fx, o, lse)
        row = cli_verdict(cli, tmp_path, fx, o, lse)
        assert report.verdict == row["verdict"], what
        assert report.message == row["message"], what
        assert report.hints == row["hints"], what
        assert report.counts["nan_rows"] == row["nan_rows"], what
        assert report.counts["o_err_ratio"] == pytest.approx(row["o_err_ratio"], rel=1e-12), what


def test_the_report_reads_like_the_table():
    fx = flashref.fixtures.load("blocksparse_empty_rows")
    o = fx.o.copy()
    o[0, 0, 0, 0] = np.nan
    report = flashref.check(fx, o, fx.lse)
    assert not report and report.verdict == "fail"
    text = str(report)
    assert text.splitlines()[0].split()[:3] == ["case", "judged", "dtype"]
    assert "blocksparse_empty_rows candidate" in " ".join(text.split())
    assert "FAIL: 1 NaN row, first O[0, 0, 0, 0]" in text
    assert "tolerances (each fixture's own)" in text
    assert "FAIL" in repr(report)


def test_golden_values_pass_every_fixture():
    for name in flashref.fixtures.names():
        fx = flashref.fixtures.load(name)
        assert flashref.check(fx, fx.o, fx.lse), name


def test_a_name_or_a_path_will_do():
    fx = flashref.fixtures.load("decode_lq1")
    assert flashref.check("decode_lq1", fx.o, fx.lse).passed
    assert flashref.check(fx.path, fx.o, fx.lse).passed
    assert flashref.fixtures.load(fx.path).name == "decode_lq1"


def test_fixture_fields():
    fx = flashref.fixtures.load("spec_masked_first_block")
    assert fx.trace is not None and set(fx.trace) == {"m", "s", "exp_old"}
    assert np.isneginf(fx.trace["m"][0])
    fx = flashref.fixtures.load("blocksparse_odd_blocks")
    assert fx.block_size == (24, 40) and fx.block_mask.dtype == np.uint8
    assert not fx.q.flags.writeable and fx.o.dtype == np.float64
    fx = flashref.fixtures.load("kv_len_zero")
    assert fx.kv_len.dtype == np.int32 and 0 in fx.kv_len
    assert flashref.fixtures.load("causal_square").causal == "bottom_right"
    assert flashref.fixtures.load("gqa_bf16").input_dtype == "bfloat16"

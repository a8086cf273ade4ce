"""bench/real_task.py's composition of the time to accuracy (#21 item 4), on hand-made runs:
the exchange priced per step by the setting in use (PowerSGD's fp32 start, DGC's warm-up
stages as hvdcomp's DGC computes them), the steps to target, and the claims' verdicts."""

import pytest

from benchmod import import_bench
from hvdcomp.compressors.sparsifiers import warmup_density

real_task = import_bench("real_task")


def _run(spec, accs, every=2):
    return dict(spec=spec, steps_per_epoch=4,
                evals=[dict(step=every * (i + 1), test_acc=a) for i, a in enumerate(accs)])


def test_plain_row():
    (steps, secs, curve), = real_task.compose([_run("none", [80.0, 89.0, 90.0])], 0.1,
                                              {"none": 0.2}, target=89.0)
    assert steps == 4 and secs == pytest.approx(4 * 0.3)
    assert [t for t, _ in curve] == pytest.approx([0.6, 1.2, 1.8])
    assert [a for _, a in curve] == [80.0, 89.0, 90.0]


def test_not_reached_and_missing_exchange():
    (steps, secs, _), = real_task.compose([_run("fp16", [80.0, 85.0])], 0.1, {"fp16": 0.1}, 89.0)
    assert steps is None and secs is None
    # no exchange time for the row's method on that link: no composition
    assert real_task.compose([_run("alq:bits=3", [90.0])], 0.1, {"none": 0.2}, 89.0) == [None]


def test_powersgd_starts_with_fp32_allreduce():
    spec = "torch-powersgd:rank=2,start_iter=3"
    ex = {"ddp:allreduce": 0.5, "ddp:powersgd:rank=2": 0.05}
    (steps, secs, curve), = real_task.compose([_run(spec, [70.0, 91.0])], 0.1, ex, 90.0)
    # steps 1-3 (PowerSGDState's iterations 0-2) vanilla, step 4 compressed
    assert steps == 4 and secs == pytest.approx(3 * 0.6 + 0.15)
    assert curve[0][0] == pytest.approx(1.2)


def test_dgc_warmup_stages_match_hvdcomp():
    spec = "dgc:density=0.001,warmup_epochs=4,warmup_steps=8"
    f = real_task.step_methods(spec, 4)
    for t in range(1, 13):
        want = warmup_density(t - 1, 0.001, 4, 0, 8, 0.25)     # the compressor's step t-1
        assert f(t) == f"dgc:density={want:g}", (t, f(t), want)
    ex = {f"dgc:density={d:g}": d for d in real_task.DGC_STAGES}
    ex["dgc:density=0.001"] = 0.001
    (_, secs, _), = real_task.compose([_run(spec, [95.0], every=10)], 0.0, ex, 90.0)
    assert secs == pytest.approx(2 * (0.25 + 0.0625 + 0.015625 + 0.00390625) + 2 * 0.001)


def test_exchange_methods_of_rows():
    hv, ddp = real_task.exchange_methods(["fp32", "PowerSGD r4", "DGC 0.1%", "ALQ 3b RS"])
    assert hv == ["none", "dgc:density=0.001", "dgc:density=0.25", "dgc:density=0.0625",
                  "dgc:density=0.015625", "dgc:density=0.00390625", "rs+alq:bits=3"]
    assert ddp == ["ddp:allreduce", "ddp:powersgd:rank=4"]


def test_claims_verdicts():
    by = {real_task.ROWS["fp32"]: [dict(final_acc=90.0), dict(final_acc=90.4)],
          real_task.ROWS["DGC 0.1%"]: [dict(final_acc=89.5), dict(final_acc=89.5)],
          real_task.ROWS["SignEF"]: [dict(final_acc=89.9), dict(final_acc=89.9)]}
    text = real_task._claims(by, 90.2)
    # DGC: 89.5 - 90.2 = -0.70, tolerance 0.5: fails by 0.20; SignEF: -0.30 holds
    assert "| DGC 0.1% - fp32 | -0.70 | 0.20 | 2 / 2 | no, by 0.20 points |" in text
    assert "| SignEF - fp32 | -0.30 | 0.20 | 2 / 2 | yes |" in text


def test_runs_trained_under_another_link_price_only_that_link():
    plain = [dict(_run("none", [90]), seed=s) for s in (0, 1)]
    auto_1g = [dict(_run("auto", [90]), seed=s, link="4x1gbit") for s in (0, 1)]
    auto_100m = [dict(_run("auto", [89]), seed=s, link="4x100mbit") for s in (0, 1, 2)]
    by, elsewhere = real_task.split_by_link(plain + auto_100m + auto_1g)
    assert by == {"none": plain, "auto": auto_1g}
    assert elsewhere == {"auto": {"4x100mbit": auto_100m}}
    assert real_task.runs_for_link(by, elsewhere, "auto", "4x100mbit") == auto_100m
    assert real_task.runs_for_link(by, elsewhere, "auto", "8x1gbit") == auto_1g
    assert real_task.runs_for_link(by, elsewhere, "none", "4x100mbit") == plain

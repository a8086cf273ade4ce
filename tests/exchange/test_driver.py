"""The lifecycle both doors share (hvdcomp.exchange.driver): Settings validated once and
their handshake record, StepStats.merge, the one checkpoint format, DGC's momentum guard."""
import dataclasses
import json
import os
import sys
import warnings

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hvdcomp  # noqa: E402
from hvdcomp.compressors import examples  # noqa: E402
from hvdcomp.exchange import StepStats  # noqa: E402
from hvdcomp.exchange.checkpoint import FORMAT  # noqa: E402
from hvdcomp.exchange.driver import Driver, Settings, resolve  # noqa: E402
from world import run_ranks  # noqa: E402

SHAPES = {"a.weight": (16, 24), "a.bias": (24,), "b.weight": (8, 16)}


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(n, torch.nn.Parameter(torch.randn(*s, generator=g))) for n, s in SHAPES.items()]


def _grads(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {n: torch.randn(*s, generator=g) for n, s in SHAPES.items()}


# --- Settings ---------------------------------------------------------------------------
@pytest.mark.parametrize("kw, exc, needle", [
    (dict(seed="3"), TypeError, "seed must be an integer"),
    (dict(seed=1.5), TypeError, "seed must be an integer"),
    (dict(seed=True), TypeError, "seed must be an integer"),
    (dict(min_compress_numel=-1), ValueError, "min_compress_numel must be >= 0"),
    (dict(min_compress_numel=16.0), TypeError, "min_compress_numel must be an integer"),
    (dict(fusion_bytes=0), ValueError, "fusion_bytes must be >= 1"),
    (dict(predivide=0.0), ValueError, "gradient_predivide_factor"),
    (dict(predivide=float("nan")), ValueError, "gradient_predivide_factor"),
    (dict(predivide="2"), ValueError, "gradient_predivide_factor"),
    (dict(collective=3), TypeError, "collective must be a string"),
])
def test_settings_refuse_invalid_values(kw, exc, needle):
    with pytest.raises(exc, match=needle):
        Settings(**kw)


def test_settings_are_frozen_and_keep_what_was_given():
    s = Settings(seed=np.int64(7), fusion_bytes=None, min_compress_numel=0)
    assert s.seed == 7 and type(s.seed) is np.int64 and s.fusion_bytes is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.seed = 8


def test_record_is_what_the_ranks_compare(monkeypatch):
    monkeypatch.delenv("HVDCOMP_COMPRESSION", raising=False)
    rec = Settings().record()
    # every field once, under Horovod's name for the predivide factor; JSON values only
    names = {f.name for f in dataclasses.fields(Settings)} - {"predivide"}
    assert set(rec) == names | {"gradient_predivide_factor"}
    assert json.loads(json.dumps(rec)) == rec
    assert rec["compression"] == "none" and rec["collective"] == "default"
    assert rec["gradient_predivide_factor"] == 1.0 and rec["fusion_bytes"] == 25 * 2**20
    # the spec as given (before parsing); its prefix names the collective
    rec = Settings(compression="auto+rs+qsgd:bits=4").record()
    assert rec["compression"] == "auto+rs+qsgd:bits=4" and rec["collective"] == "reduce_scatter"
    assert Settings(compression="qsgd", collective="allgather").record()["collective"] \
        == "allgather"
    comp = hvdcomp.get("qsgd:bits=4")
    assert Settings(compression=comp).record()["compression"] == comp.spec()
    monkeypatch.setenv("HVDCOMP_COMPRESSION", "alq:bits=3")
    assert Settings().record()["compression"] == "alq:bits=3"


def test_resolve(monkeypatch):
    monkeypatch.setenv("HVDCOMP_COMPRESSION", "qsgd:bits=4")
    comp, coll = resolve(None)
    assert comp.spec() == hvdcomp.get("qsgd:bits=4").spec() and coll is None
    comp, coll = resolve("rs+terngrad")
    assert comp.name == "terngrad" and coll == "reduce_scatter"
    mine = hvdcomp.get("signef")
    assert resolve(mine) == (mine, None)
    with pytest.raises(hvdcomp.ConfigError, match="unknown setting 'bitz'"):
        resolve("qsgd:bitz=3")
    with pytest.raises(TypeError, match="compression must be"):
        resolve(3)


def test_one_handshake_names_each_difference():
    def build(rank, tp):
        Settings(compression="qsgd", seed=rank).agree(tp, "the test settings", extra="same",
                                                      door=f"d{rank % 2}")
    got = run_ranks(3, build)
    for e in got:
        assert isinstance(e, hvdcomp.Mismatch), e
        text = str(e)
        assert "the test settings" in text
        assert "  seed: 0 on rank 0; 1 on rank 1; 2 on rank 2" in text, text
        assert '  door: "d0" on ranks 0, 2; "d1" on rank 1' in text, text
        assert "extra" not in text and "compression" not in text
    assert run_ranks(2, lambda r, tp: Settings(seed=4).agree(tp, "x", a=1)) == [None, None]


# --- StepStats.merge ------------------------------------------------------------------------
def test_step_stats_merge_sums_field_by_field():
    a = StepStats(step=3, bytes_sent=100, fp32_bytes=400, recv_bytes=90, traffic_bytes=150.5,
                  host_bytes=33, compressors={"w": "qsgd"}, nonfinite=["w"], events=["e1"], joined=1,
                  encode_s=0.25, comm_s=0.5, decode_s=0.125, reduce_s=0.0625)
    b = StepStats(step=9, bytes_sent=7, fp32_bytes=28, recv_bytes=6, traffic_bytes=10.25,
                  host_bytes=5, compressors={"v": "none", "w": "fp16"}, nonfinite=["v"],
                  events=["e2", "e3"], joined=0, encode_s=1.0, comm_s=2.0, decode_s=4.0,
                  reduce_s=8.0)
    want = {"step": 3, "bytes_sent": 107, "fp32_bytes": 428, "recv_bytes": 96,
            "traffic_bytes": 160.75, "host_bytes": 38,
            "compressors": {"w": "fp16", "v": "none"},
            "nonfinite": ["w", "v"], "events": ["e1", "e2", "e3"], "joined": 1,
            "encode_s": 1.25, "comm_s": 2.5, "decode_s": 4.125, "reduce_s": 8.0625}
    assert set(want) == {f.name for f in dataclasses.fields(StepStats)}   # every field
    assert a.merge(b) is a
    assert {k: getattr(a, k) for k in want} == want
    assert a.ratio == 428 / 107
    assert b.compressors == {"v": "none", "w": "fp16"} and b.events == ["e2", "e3"]
    # joined is the largest count, not a sum
    assert StepStats(joined=1).merge(StepStats(joined=2)).joined == 2


# --- the checkpoint format -----------------------------------------------------------------
def _step(d, rank, step):
    for n, p in d.exchange.entries.items():
        p.param.grad = _grads(rank, step)[n]
    d.begin()
    for n in reversed(list(SHAPES)):
        d.exchange.ready(n)
    out = {n: t.clone() for n, t in d.finish().items()}
    d.update()
    return out


MODEL_SCOPE = "uniformef:bits=6,bucket_size=256,variance_target=0.03,step_scope=model"


@pytest.mark.parametrize("spec", ["signef", MODEL_SCOPE])
def test_checkpoint_round_trip_resumes_bit_exactly(spec):
    """(uniformef with step_scope "model": its step depends on every tensor's last step.)"""
    settings = Settings(compression=spec, min_compress_numel=16, seed=5)

    def body(rank, tp):
        d = Driver(_params(), settings, tp, ident=0)
        for step in range(2):
            _step(d, rank, step)
        sd = d.state_dict()
        assert set(sd) == {"format", "rank", "world_size", "step", "compression",
                           "compressor_state", "second_stage_state", "params_before"}
        assert (sd["rank"], sd["world_size"]) == (rank, 2)
        assert sd["format"] == FORMAT and sd["step"] == 2 and sd["second_stage_state"] == []
        # a fresh exchange restored from it continues exactly as the original
        e = Driver(_params(), settings, tp, ident=1)
        e.load_state_dict(torch.load(_saved(sd, rank), weights_only=False))
        assert e.step == 2
        mine, theirs = d.compression.state_dict(), e.compression.state_dict()
        assert len(mine["residuals"]) == 2 and _same(mine, theirs)
        assert spec == "signef" or mine["mean_square"]["gradients"] > 0
        a, b = _step(d, rank, 2), _step(e, rank, 2)
        d.exchange.close()
        e.exchange.close()
        return all(torch.equal(a[n], b[n]) for n in a)

    assert run_ranks(2, body) == [True, True]


def _saved(sd, rank):
    path = f"/tmp/hvdcomp-test-driver-{os.getpid()}-{rank}.pt"
    torch.save(sd, path)
    return path


def test_check_state_refuses_what_it_cannot_load():
    def body(rank, tp):
        d = Driver(_params(), Settings(compression="signef", min_compress_numel=16), tp)
        sd = d.state_dict()
        errors = []
        for bad in ({**sd, "compression": "qsgd:bits=4"}, {**sd, "format": FORMAT + 1},
                    {k: v for k, v in sd.items() if k != "compressor_state"},
                    {**sd, "second_stage_state": [{}]}, "not a dict"):
            try:
                d.load_state_dict(bad)
            except ValueError as e:
                errors.append(str(e))
        # a checkpoint from before the format existed (step, spec and state only) loads
        old = {k: sd[k] for k in ("step", "compression", "compressor_state")}
        d.load_state_dict(dict(old, step=4))
        d.exchange.close()
        return errors, d.step

    for errors, step in run_ranks(2, body):
        assert step == 4 and len(errors) == 5, errors
        assert "saved with compression 'qsgd:bits=4'" in errors[0]
        assert f"format {FORMAT + 1}" in errors[1]
        assert "'compressor_state'" in errors[2] and "'compressor_state'" in errors[4]
        assert "1 second-stage states" in errors[3]


# --- a checkpoint of another world size (an elastic restart that resized the job) -----------
STATEFUL = [spec for name, spec in examples().items()
            if hvdcomp.get(spec).keeps_state
            and type(hvdcomp.get(spec)).__module__.startswith("hvdcomp.")] + [MODEL_SCOPE]


def _same(a, b) -> bool:
    """Nested dicts, lists and tensors equal, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_every_stateful_compressor_declares_its_shared_state():
    assert {s.split(":")[0] for s in STATEFUL} >= {"alq", "amq", "dgc", "laq", "powersgd",
                                                   "signef", "topk"}
    assert hvdcomp.get("alq").shared_state == ("levels", "level_version")
    assert hvdcomp.get("powersgd").shared_state == ("q",)
    assert hvdcomp.get("dgc").shared_state == hvdcomp.get("signef").shared_state == ()


@pytest.mark.parametrize("spec", STATEFUL)
def test_another_world_size_keeps_the_shared_state_and_resets_the_rest(spec, caplog):
    """Saved by 3 ranks, loaded by 2 (each loads rank 0's checkpoint): what the compressor
    declares shared is the same on every rank of the old world and carries over; the
    rest (this rank's own) is reset, with a warning naming it; the step carries over and
    the new world's ranks go on with identical averages."""
    settings = Settings(compression=spec, min_compress_numel=16, seed=5)
    shared = hvdcomp.get(spec).shared_state

    def driver(tp, ident):
        d = Driver(_params(), settings, tp, ident=ident)
        if spec.startswith("dgc"):                  # DGC applies the optimizer's momentum
            d.momentum.attach(torch.optim.SGD([e.param for e in d.exchange.entries.values()],
                                              lr=0.1, momentum=0.9))
        return d

    def first(rank, tp):
        d = driver(tp, 0)
        for step in range(4):
            _step(d, rank, step)
        sd = d.state_dict()
        d.exchange.close()
        return sd

    old = run_ranks(3, first)
    for r in old:
        if isinstance(r, BaseException):
            raise r
    assert [sd["world_size"] for sd in old] == [3, 3, 3]
    states = [sd["compressor_state"] for sd in old]
    for k in shared:                       # the declaration is true: equal on every rank
        assert all(_same(states[0][k], st[k]) for st in states), k
    own = sorted(k for k, v in states[0].items() if k not in shared and v)
    assert set(states[0]) - set(shared) == set(own) or not own, states[0].keys()

    def second(rank, tp):
        e = driver(tp, 1)
        e.load_state_dict(torch.load(_saved(old[0], rank), weights_only=False))
        loaded, step = e.compression.state_dict(), e.step
        out = _step(e, rank, 4)
        e.exchange.close()
        return loaded, step, out

    with caplog.at_level("WARNING", logger="hvdcomp"):
        res = run_ranks(2, second)
    for r in res:
        if isinstance(r, BaseException):
            raise r
    for loaded, step, out in res:
        assert step == 4
        for k in shared:
            assert _same(loaded[k], states[0][k]), k
        for k in set(loaded) - set(shared):
            assert not loaded[k], (k, loaded[k])             # reset, as at the first step
        assert all(torch.isfinite(t).all() for t in out.values())
        assert all(torch.equal(out[n], res[0][2][n]) for n in out)   # identical averages
    warned = [r.getMessage() for r in caplog.records if "world size 3" in r.getMessage()]
    if own:
        assert warned and all(k in warned[0] for k in own), (own, warned)


def test_own_rank_refuses_another_ranks_checkpoint_of_this_world_size():
    settings = Settings(compression="signef", min_compress_numel=16)

    def body(rank, tp):
        d = Driver(_params(), settings, tp)
        sd = dict(d.state_dict(), rank=1 - rank)
        d.load_state_dict(sd)                      # the drop-in optimizer's rule: loads
        try:
            d.load_state_dict(sd, own_rank=True)   # the DDP hook's: one file per rank
        except ValueError as e:
            return str(e)
        finally:
            d.exchange.close()

    for rank, text in enumerate(run_ranks(2, body)):
        assert f"checkpoint of rank {1 - rank} of 2, this is rank {rank} of 2" in text


# --- DGC's momentum guard --------------------------------------------------------------------
def test_momentum_guard_names_the_reduce_scatter_pieces():
    def body(rank, tp):
        d = Driver(_params(), Settings(compression="dgc:density=0.1", min_compress_numel=16,
                                       collective="reduce_scatter"), tp)
        try:
            d.begin()
            raise AssertionError("DGC without an optimizer was accepted")
        except RuntimeError as e:
            assert "attach_optimizer" in str(e), e
        d.momentum.attach(torch.optim.SGD([e.param for e in d.exchange.entries.values()],
                                          lr=0.1, momentum=0.7))
        d.momentum.set_momentum()
        comp = d.compression
        pieces = d.exchange.collective.pieces()
        corrected = set(d.momentum.corrected)
        got = {p.label: comp.momentum_of(p.label) for p in pieces if p.name in corrected}
        got.update({n: comp.momentum_of(n) for n in corrected})
        d.exchange.close()
        return len(pieces), sorted(corrected), got

    for n_pieces, corrected, got in run_ranks(2, body):
        # the 2-D tensors are DGC's (the bias is too small); each is cut into shards
        assert corrected == ["a.weight", "b.weight"] and n_pieces >= 2
        assert len(got) > 2 and all(v == 0.7 for v in got.values()), got


def test_the_doors_checkpoint_forms():
    """The optimizer's (hvdcomp's part nested under a key: split) and the hook's (with
    the rank and the world size), each checked before anything is loaded."""
    def body(rank, tp):
        d = Driver(_params(), Settings(compression="signef", min_compress_numel=16), tp)
        _step(d, rank, 0)
        sd = d.state_dict()
        rest, mine = d.split({"state": {}, "param_groups": [], "hvdcomp": sd}, "hvdcomp",
                             allow_missing=False)
        assert rest == {"state": {}, "param_groups": []} and mine is sd
        errors = []
        try:                        # signef keeps residuals: refused without hvdcomp's part
            d.split({"state": {}}, "hvdcomp", allow_missing=False)
        except ValueError as e:
            errors.append(str(e))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert d.split({"state": {}}, "hvdcomp", allow_missing=True) == ({"state": {}},
                                                                                None)
        ranked = d.rank_state_dict()        # (every checkpoint holds the rank and size)
        assert (ranked["rank"], ranked["world_size"]) == (sd["rank"], sd["world_size"]) == (
            rank, 2)
        assert ranked.keys() == sd.keys() and ranked["step"] == sd["step"] == 1
        d.step = 7
        for bad in ({**d.rank_state_dict(), "rank": 1 - rank},
                    {**d.rank_state_dict(), "format": "x"}):
            try:
                d.load_rank_state_dict(bad, "Thing")
            except ValueError as e:
                errors.append(str(e))
        d.load_rank_state_dict(dict(d.rank_state_dict(), step=3), "Thing")
        d.exchange.close()
        return errors, [str(w.message) for w in caught], d.step

    for rank, (errors, warned, step) in enumerate(run_ranks(2, body)):
        assert len(errors) == 3 and step == 3, errors
        assert errors[0].startswith(f"rank {rank}: the state_dict has no 'hvdcomp' entry")
        assert len(warned) == 1 and "hvdcomp's step stays at 1" in warned[0], warned
        assert errors[1] == (f"checkpoint of rank {1 - rank} of 2, this is rank {rank} of "
                             f"2: save and load one checkpoint per rank (residuals are per "
                             f"rank)")
        assert errors[2] == "not a Thing checkpoint (format 'x')"


def test_close_frees_only_the_carriers_the_door_owns():
    class Carrier:
        freed = 0

        def free(self):
            self.freed += 1

    def body(rank, tp):
        freed = []
        tp.free = lambda: freed.append("transport")
        settings = Settings(compression="qsgd:bits=4", min_compress_numel=16,
                            allreduce_summable=False)     # (the allreduce is only held)
        mine, lent = Carrier(), Carrier()
        Driver(_params(), settings, tp, mine, ident=0, owns_carriers=True).close()
        Driver(_params(), settings, tp, lent, ident=1).close()
        return freed, mine.freed, lent.freed

    assert run_ranks(2, body) == [(["transport"], 1, 0)] * 2

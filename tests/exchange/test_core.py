"""hvdcomp.exchange without MPI: the plan's routing, the fusion order, the handshake, the
ALQ/AMQ refit and LAQ's parameter change (one-rank and fake transports)."""
import numpy as np
import pytest
import torch

import hvdcomp
from hvdcomp.exchange import Exchange, Plan, refit
from hvdcomp.exchange.buckets import agree, fuse
from hvdcomp.transport import Allreduce, Transport


class OneRank(Transport):
    """Rank ``rank`` of ``size``, every other rank an echo of this one (or ``others``)."""
    name = "fake"

    def __init__(self, rank=0, size=1, others=None, root_payload=None):
        super().__init__()
        self.rank, self.size = rank, size
        self.others, self.root_payload = others, root_payload
        self.broadcasts = []

    def _allgather_counts(self, n):
        return [n] * self.size

    def _allgatherv(self, data, counts):
        other = np.array(data, copy=True) if self.others is None else self.others
        return [np.array(data, copy=True) if r == self.rank else other
                for r in range(self.size)]

    def allreduce_sum(self, arr):
        return np.asarray(arr, dtype=np.float64) * self.size

    def broadcast(self, arr, root=0):
        self.broadcasts.append(np.array(arr, copy=True))
        return arr if self.rank == root else self.root_payload


class Float32Sums(Allreduce):
    dtypes = (torch.float32,)


def _params():
    return [("emb.weight", torch.zeros(40, 40, dtype=torch.float64)),
            ("fc.weight", torch.zeros(50, 30)),
            ("fc.bias", torch.zeros(50)),
            ("small.weight", torch.zeros(3, 3)),
            ("steps", torch.zeros(4, 4, dtype=torch.int64))]


def test_plan_routes_and_chooses_the_path():
    qsgd = hvdcomp.get("qsgd:bits=4")
    plan = Plan(_params(), qsgd, OneRank(), None, min_compress_numel=16, compress_1d=False)
    assert plan.compressor_names() == {"emb.weight": "qsgd", "fc.weight": "qsgd",
                                       "fc.bias": "none", "small.weight": "none",
                                       "steps": "none"}
    assert [e.tensor_id for e in plan.entries.values()] == [0, 2, 1, 3, 4]  # name-sorted ids
    assert not any(e.allreduce for e in plan.entries.values())
    plan = Plan(_params(), qsgd, OneRank(), Float32Sums(), min_compress_numel=16,
                compress_1d=True)
    assert plan.compressor_names()["fc.bias"] == "qsgd"
    # summable and summed in float32 by the carrier: small.weight and steps (none)
    assert {n for n, e in plan.entries.items() if e.allreduce} == {"small.weight", "steps"}
    with pytest.raises(ValueError, match="unique"):
        Plan(_params() + [("fc.bias", torch.zeros(2))], qsgd, OneRank(), None,
             min_compress_numel=16, compress_1d=False)


@pytest.mark.parametrize("spec", ["none", "qsgd:bits=4,bucket_size=64", "fp16"])
def test_keys_carry_the_parameter_so_decode_checks_dtype_and_shape(spec):
    """#15 item 4: a message whose dtype byte or shape differs from the receiver's parameter
    (same numel) is a WireFormatError; for ``none`` a float32 payload read as int32 would
    otherwise decode to integers off by up to 1e9."""
    from hvdcomp.wire import DTYPES, Message
    plan = Plan(_params(), hvdcomp.get(spec), OneRank(), None, min_compress_numel=16,
                compress_1d=False)
    e = plan.entries["fc.weight"]                       # float32 (50, 30)
    key = e.key(4, 0, 1, 9)
    assert key.shape == (50, 30) and key.dtype == torch.float32
    msg = e.compressor.encode(torch.randn(50, 30), key)
    acc = torch.zeros(1500)
    assert e.compressor.decode(Message.from_bytes(msg.to_bytes()), key, acc)
    for field, value, match in (("dtype", DTYPES[torch.int32], "dtype mismatch"),
                                ("dtype", DTYPES[torch.float64], "dtype mismatch"),
                                ("shape", (30, 50), "shape"), ("shape", (1500,), "shape")):
        bad = Message.from_bytes(Message(**{**msg.__dict__, field: value}).to_bytes())
        out = torch.zeros(1500)
        with pytest.raises(hvdcomp.WireFormatError, match=match):
            e.compressor.decode(bad, key, out)
        assert not out.any()


def test_fusion_order_is_reverse_registration():
    p = _params()          # bytes: 12800, 6000, 200, 36, 128
    assert fuse(p, 6000) == [["steps", "small.weight", "fc.bias", "fc.weight"], ["emb.weight"]]
    assert fuse(p, 1) == [[n] for n, _ in reversed(p)]
    with pytest.raises(ValueError):
        fuse(p, 0)


def test_disagreeing_ranks_raise():
    agree(OneRank(0, 3), "same", "the settings")
    with pytest.raises(RuntimeError, match=r"ranks \[1, 2\] disagree with rank 0 on the x"):
        agree(OneRank(0, 3, others=np.zeros(32, np.uint8)), "mine", "the x")
    with pytest.raises(RuntimeError, match="disagree"):
        Exchange(_params(), hvdcomp.get("qsgd:bits=4"),
                 OneRank(0, 2, others=np.zeros(32, np.uint8)))


def test_refit_sizes_the_payload_by_fit_size_and_adopts_roots_table():
    alq = hvdcomp.get("alq:bits=3,bucket_size=64")
    alq.observe(torch.randn(1000))
    table = np.sort(np.random.default_rng(0).random(alq.fit_size())).astype(np.float32)
    table[0], table[-1] = 0.0, 1.0
    tp = OneRank(1, 2, root_payload=table)
    refit(alq, tp, 99)
    assert tp.broadcasts[0].shape == (alq.fit_size(),) and not tp.broadcasts[0].any()
    assert np.array_equal(alq.levels.numpy(), table) and alq.level_version == 1
    refit(alq, tp, 100)                     # nothing observed on any rank: no collective
    assert len(tp.broadcasts) == 1 and alq.level_version == 1


def test_after_step_gives_laq_the_parameter_change_and_refits_alq():
    params = [("w", torch.nn.Parameter(torch.ones(40, 40))),
              ("b", torch.nn.Parameter(torch.ones(40)))]
    seen = []

    class Probe(hvdcomp.LAQ):
        def after_step(self, step, sq):
            seen.append((step, sq))

    ex = Exchange(params, Probe(bits=4), OneRank(), min_compress_numel=16)
    ex.before_step()
    with torch.no_grad():
        params[0][1].add_(0.5)
        params[1][1].sub_(2.0)
    ex.after_step(7)
    assert seen == [(7, 1600 * 0.25 + 40 * 4.0)]
    ex.close()

    alq = hvdcomp.get("alq:bits=3,bucket_size=64,refit_steps=1,refit_every=0")
    ex = Exchange(params, alq, OneRank(), min_compress_numel=16)
    for step in range(2):
        for _, p in params:
            p.grad = torch.randn(p.shape)
        ex.begin(step)
        ex.finish()
        ex.before_step()
        ex.after_step(step)
    assert alq.level_version == 1          # statistics of step 0, table fitted before step 1
    ex.close()


# --- the start-up log (newcomer trial item 5): one line each, details at DEBUG ------------

def test_cost_model_summary_by_hand():
    from hvdcomp.auto import CodecCost, CostModel, LinkCost
    link = LinkCost(ar_latency=1e-3, ar_per_byte=1e-10, ag_latency=2e-4, ag_per_byte=4e-10)
    codec = CodecCost(encode_fixed=1e-4, encode_per_elem=5e-9, decode_fixed=2e-5,
                      decode_per_elem=2e-9, bytes_fixed=12, bytes_per_elem=0.375)
    # 1e-10 s/byte = 10 GB/s; 4e-10 = 2.5 GB/s
    assert CostModel(link, codec, 4).summary() == (
        "allreduce (1 ms, 10 GB/s), allgather (0.2 ms, 2.5 GB/s), encode 5 ns and decode "
        "2 ns per element")
    link = LinkCost(1e-3, 1e-10, 2e-4, 0.0, aa_latency=5e-4, aa_per_byte=1e-9)
    assert CostModel(link, codec, 4, allreduce=False).summary() == (
        "allgather (0.2 ms, no per-byte cost), all-to-all (0.5 ms, 1 GB/s), encode 5 ns and "
        "decode 2 ns per element")


@pytest.mark.parametrize("fusion", [1 << 20, None])
def test_start_up_log_is_one_line_each_with_the_cost_model_at_debug(fusion, caplog):
    from hvdcomp.auto import CodecCost, LinkCost
    link = LinkCost(ar_latency=1e-3, ar_per_byte=1e-10, ag_latency=2e-4, ag_per_byte=4e-10)
    codec = CodecCost(1e-4, 5e-9, 2e-5, 2e-9, 12, 0.375)
    auto = hvdcomp.Auto("qsgd:bits=4", link=link, codec=codec)
    params = [(n, torch.nn.Parameter(p.float())) for n, p in _params()[1:4]]
    caplog.set_level("DEBUG", logger="hvdcomp")
    ex = Exchange(params, auto, OneRank(), allreduce=Float32Sums(), fusion_bytes=fusion,
                  min_compress_numel=16)
    ex.close()
    info = [r.getMessage() for r in caplog.records
            if r.name == "hvdcomp" and r.levelname == "INFO"]
    debug = [r.getMessage() for r in caplog.records
             if r.name == "hvdcomp" and r.levelname == "DEBUG"]
    # no "0 buckets" where the caller (DDP) forms them: the count only where it is known
    where = " in 1 buckets" if fusion else ""
    assert info == [
        f"exchange: 3 tensors{where}, 1 ranks, transport fake, compression "
        f"auto(qsgd:bits=4,bucket_size=8192,entropy=False; fallbacks=none,fp16)",
        f"Auto's plan (tensors per path): {_counts(ex)}; cost model: allreduce (1 ms, "
        f"10 GB/s), allgather (0.2 ms, 2.5 GB/s), encode 5 ns and decode 2 ns per element"]
    assert debug == [f"Auto's cost model: {ex.cost_model.as_dict()}"]
    # each tensor's compressor by spec (what the doors' .specs show), settings included
    full = {"qsgd": "qsgd:bits=4,bucket_size=8192,entropy=False", "fp16": "fp16",
            "none": "none"}
    names = ex.plan.compressor_names()
    assert set(names.values()) <= set(full)
    assert ex.plan.compressor_specs() == {n: full[c] for n, c in names.items()}


def _counts(ex):
    """{compressor name: tensors} in registration order, as the log counts them."""
    out = {}
    for e in ex.entries.values():
        out[e.compressor.name] = out.get(e.compressor.name, 0) + 1
    return out

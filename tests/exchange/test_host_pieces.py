"""The hierarchical exchange's in-host messages (hvdcomp/exchange/host_pieces.py) on one
process: the host mean of each piece from raw float32 frames, hand-worked, with a NaN
contribution, a sum that overflows, and a piece of the wrong size."""
import numpy as np
import pytest
import torch

import hvdcomp
from hvdcomp.errors import WireFormatError
from hvdcomp.exchange.host_pieces import HostPieces
from hvdcomp.exchange.plan import Entry
from hvdcomp.transport import Incoming, Stamp

L = 3                                   # ranks per host; this process plays local rank 1
ME = 1
STAMP = Stamp(4, 0, False)


def layout():
    e = Entry("w", torch.nn.Parameter(torch.zeros(4, 3)), 0, hvdcomp.get("none"), False,
              hier=True)
    return HostPieces({"w": e}, L, ME, first_id=10, seed=1)


def host_means(grads, pieces=None):
    """Local rank l's frames (from its gradient grads[l]) as each rank would send them,
    then this rank's means: what stage 1 computes."""
    pieces = pieces or layout()
    frames = [HostPieces(pieces.entries, L, l, 10, 1).frames(
        [pieces.entries["w"]], {"w": grads[l]}, False, STAMP)[ME] for l in range(L)]
    mine = pieces.owned(["w"], ME)
    return pieces, pieces.means(mine, Incoming(frames, len(mine)), {"w": grads[ME]})


def test_mean_of_my_piece_is_the_sum_in_local_rank_order_over_l():
    grads = [torch.arange(12, dtype=torch.float32) * (l + 1) + 0.1 for l in range(L)]
    pieces, means = host_means(grads)
    p = pieces.pieces["w"][ME]
    assert (p.lo, p.hi) == (4, 8)                  # 12 elements cut in 3
    want = torch.zeros(4)
    for g in grads:
        want.add_(g[4:8])
    assert torch.equal(means["w"].reshape(-1), want / L)
    # this rank's own frame carries no bytes: its piece is read from its gradient
    own = pieces.frames([pieces.entries["w"]], {"w": grads[ME]}, False, STAMP)[ME]
    assert Incoming([own], 1).raw(0, 0).size == 0


def test_nonfinite_contribution_makes_the_mean_nan():
    grads = [torch.ones(12) for _ in range(L)]
    grads[2] = grads[2].clone()
    grads[2][5] = float("inf")
    _, means = host_means(grads)
    assert torch.isnan(means["w"]).all()


def test_overflowing_sum_of_finite_contributions_is_divided_first():
    big = torch.full((12,), 3e38)
    _, means = host_means([big, big, big])
    want = torch.zeros(4)
    for _ in range(L):
        want.add_(big[4:8] / L)
    assert torch.isfinite(means["w"]).all() and torch.equal(means["w"].reshape(-1), want)


def test_piece_of_the_wrong_size_is_a_wire_format_error():
    pieces = layout()
    grads = [torch.ones(12) for _ in range(L)]
    frames = [HostPieces(pieces.entries, L, l, 10, 1).frames(
        [pieces.entries["w"]], {"w": grads[l]}, False, STAMP)[ME] for l in range(L)]
    from hvdcomp.transport import join_frames
    frames[0] = join_frames([np.zeros(12, np.uint8)], stamp=STAMP)   # 3 floats, not 4
    mine = pieces.owned(["w"], ME)
    with pytest.raises(WireFormatError, match=r"local rank 0 sent 12 bytes for w\[4:8\]"):
        pieces.means(mine, Incoming(frames, 1), {"w": grads[ME]})

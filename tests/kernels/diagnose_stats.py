"""Where the GPU's ALQ/AMQ statistics part from the host build's (a diagnostic for
launch/gpu-check, not a test): for the case that test_stats.py's
test_gpu_equals_host_bitwise_and_reference[l2] failed on an H200 (2,097,157 elements,
buckets of 8192; bench/results/gpu_check_h200.md), compares stage by stage, GPU against the
host build, bit for bit: the float64 bucket norms (hvd_stats_norms), each chunk's binned
sums (hvd_stats_hist_partial), and the reduced histogram; for the first chunk that differs,
the elements whose bin differs.  Prints what it finds; exit status 0 whatever it finds.

    python tests/kernels/diagnose_stats.py [n] [bucket_size]
"""
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_cases import gradient  # noqa: E402

from hvdcomp.backends import cuda, host  # noqa: E402
from hvdcomp.ops import level_stats as S  # noqa: E402
from hvdcomp.backends._common import grid_for  # noqa: E402


def partials(be, x, nrm, bs):
    n = x.numel()
    nc = (n + S.HIST_CHUNK - 1) // S.HIST_CHUNK
    out = torch.empty(nc * S.HIST_COLS, dtype=torch.float64, device=x.device)
    be.launch("hvd_stats_hist_partial", grid_for(nc, S.CHUNK_BLOCK), S.CHUNK_BLOCK,
              (x, n, nrm, bs, S._edges_on(x.device), S.HIST_CHUNK, out))
    return out.view(nc, S.HIST_COLS)


def main(n=S.HIST_CHUNK * S.REDUCE_GROUP + 5, bs=8192):
    n, bs = int(n), int(bs)
    x = gradient(n, bs, seed=n + bs)
    xc = x.cuda()
    for norm in ("l2", "linf"):
        hn = S.bucket_norms64.kernels(host.backend, x, bs, norm)
        gn = S.bucket_norms64.kernels(cuda.backend, xc, bs, norm).cpu()
        bad = (hn.view(torch.int64) != gn.view(torch.int64)).nonzero().flatten().tolist()
        print(f"{norm}: bucket norms differing (GPU vs host): {len(bad)} of {hn.numel()}")
        for b in bad[:5]:
            print(f"  bucket {b}: host {float(hn[b]).hex()} gpu {float(gn[b]).hex()}")
        hp = partials(host.backend, x, hn, bs)          # both from the host's norms
        gp = partials(cuda.backend, xc, hn.cuda(), bs).cpu()
        rows = (hp.view(torch.int64) != gp.view(torch.int64)).any(dim=1).nonzero().flatten()
        print(f"{norm}: chunks whose binned sums differ (same norms): {rows.numel()} "
              f"of {hp.shape[0]}")
        if rows.numel():
            c = int(rows[0])
            cols = (hp[c].view(torch.int64) != gp[c].view(torch.int64)).nonzero().flatten()
            print(f"  chunk {c}, columns {cols.tolist()[:12]}: host "
                  f"{hp[c, cols[:4]].tolist()} gpu {gp[c, cols[:4]].tolist()}")
            lo, hi = c * S.HIST_CHUNK, min(n, (c + 1) * S.HIST_CHUNK)
            xs = x[lo:hi].double()
            safe = hn[lo // bs].item() or 1.0
            r = (xs.abs() / safe).clamp(0, 1)
            hb = S.hist_bins.kernels(host.backend, r)
            gb = S.hist_bins.kernels(cuda.backend, r.cuda()).cpu()
            moved = (hb != gb).nonzero().flatten()
            print(f"  elements of that chunk binned differently: {moved.numel()}")
            for i in moved[:5].tolist():
                print(f"    x[{lo + i}] = {float(x[lo + i]).hex()}: r {float(r[i]).hex()} "
                      f"host bin {int(hb[i])} gpu bin {int(gb[i])}")
        hh = S.histogram_stats.kernels(host.backend, x, bs, norm).numpy()
        gh = S.histogram_stats.kernels(cuda.backend, xc, bs, norm).cpu().numpy()
        diff = np.nonzero(hh.view(np.int64) != gh.view(np.int64))[0]
        print(f"{norm}: histogram entries differing: {diff.size}; first {diff[:8].tolist()}")


if __name__ == "__main__":
    main(*sys.argv[1:])

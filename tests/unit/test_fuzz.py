"""The decoders against mutated wire messages (issue #15): a seeded run of the fuzzer of
bench/fuzz.py, about 20,000 trials over every compressor (entropy coding on and off where it
has the setting), on the reference and, where they build, the kernels, the CRC recomputed
for half of the messages so that the mutations reach the decoders.

Every decode must raise nothing but WireFormatError, take under 1 s of CPU time (a wall-time
alarm catches hangs), leave the accumulator's shape alone and give finite values unless a
message was NONFINITE.  bench/fuzz.py is the long run (a million messages and its tables in
bench/results/fuzz.md).
"""
import pytest
import torch

import hvdcomp
from bench import fuzz as F

TRIALS = 20_000
SPECS = F.specs()
BACKENDS = ["reference"] + (["kernels"] if hvdcomp.backends.kernel_backend(
    torch.device("cpu")) is not None else [])


def test_both_backends_are_fuzzed():
    """The kernel path is fuzzed too wherever the host kernels build (a visible skip
    otherwise, not a silent reference-only run)."""
    if "kernels" not in BACKENDS:
        pytest.skip("the host kernels do not build here: only the reference is fuzzed")
    assert BACKENDS == ["reference", "kernels"]


@pytest.fixture(scope="module")
def cases():
    return F.make_cases(SPECS, seed=15)


@pytest.mark.parametrize("spec", SPECS)
def test_fuzzed_messages(cases, spec):
    torch.set_num_threads(1)
    rep = F.fuzz(TRIALS // len(SPECS), seed=15, backends=BACKENDS, spec_list=[spec],
                 cases=cases)
    assert sum(rep.trials.values()) == TRIALS // len(SPECS)
    for key, counts in rep.outcomes.items():
        assert counts["accepted"] + counts["rejected"] > 0, key
    bad = rep.failures()
    assert not bad, "\n".join(f"{e['backend']} {e['shape']} {e['dtype']} {e['kind']}: "
                              f"{e['outcome']}: {e['detail']}" for e in bad)

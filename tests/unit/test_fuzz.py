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

# `none`, `fp16` and `bf16` (hvdcomp/compressors/cast.py, under conversion to the ops layer)
# decode non-finite raw values (fp16's encoder also sends overflowed casts unflagged): known,
# reported as XFAIL until cast.py rejects them; any other failure of theirs still fails.
NONFINITE_KNOWN = {"none", "fp16", "bf16"}


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
    if bad and spec in NONFINITE_KNOWN and all(e["outcome"] == "nonfinite" for e in bad):
        pytest.xfail(f"{spec}: {bad[0]['detail']} ({rep.failure_count()} trials; cast.py "
                     f"decodes non-finite values)")
    assert not bad, "\n".join(f"{e['backend']} {e['shape']} {e['dtype']} {e['kind']}: "
                              f"{e['outcome']}: {e['detail']}" for e in bad)

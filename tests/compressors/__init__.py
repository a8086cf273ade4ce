"""Tests of the bucketed stochastic quantizers (QSGD, QSGDinf, NUQSGD, ALQ, AMQ) and of
hvdcomp.levels.  A package, so that its module names (quant.test_levels, ...) cannot clash
with test modules of the same base name elsewhere under tests/."""

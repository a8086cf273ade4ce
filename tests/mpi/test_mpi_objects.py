"""Issue 24 items 3 and 4 through the drop-in optimizer: worker_objects.py under mpirun on
2 ranks, each of its named cases one pytest case (cases.py), with a timeout that turns a
hang into a failure (and cases.py's barrier, which aborts a job whose ranks stop meeting)."""
import os

import cases

globals().update(cases.pytest_module(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker_objects.py"), 2, 600,
    HVDCOMP_CASE_WAIT="120"))

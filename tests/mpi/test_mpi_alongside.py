"""Issue 24 item 5 through the drop-in optimizer: worker_alongside.py under mpirun on 2
ranks (synchronized batch norm and the application's own Horovod collectives in every
step next to hvdcomp's exchange, over both transports, with ranks in and out of phase),
each of its named cases one pytest case (cases.py), with a timeout that turns a hang into
a failure (and cases.py's barrier, which aborts a job whose ranks stop meeting)."""
import os

import cases

globals().update(cases.pytest_module(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker_alongside.py"), 2, 600,
    HVDCOMP_CASE_WAIT="120",
                                   # Horovod reports a collective some rank never starts
                                   # after 10 s (not 60)
                                   HOROVOD_STALL_CHECK_TIME_SECONDS="10"))

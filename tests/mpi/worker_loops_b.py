"""Issue 14, cases 2 and 4-7 (several optimizers, DGC and param groups, sparse gradients,
hvd.join(), casts): see worker_loops.py."""
from worker_loops import main

if __name__ == "__main__":
    main("b")

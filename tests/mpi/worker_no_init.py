"""A script that never calls hvd.init(): building hvdcomp's DistributedOptimizer raises a
clear RuntimeError on every rank (the test checks that mpirun returns, with the message)."""
import torch

import hvdcomp.torch as hvd

model = torch.nn.Linear(4, 2)
hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                         named_parameters=model.named_parameters(), compression="qsgd")

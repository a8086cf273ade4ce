"""The main job's network trained with PyTorch Lightning, gradients exchanged by hvdcomp's DDP
communication hook (real encoded bytes) through Lightning's own DDP strategy:

    .venv/bin/python examples/lightning_mnist.py                    # 2 CPU processes, ALQ 3 bits
    .venv/bin/python examples/lightning_mnist.py --compression dgc:density=0.01 --devices 4

The one hvdcomp-specific part is the strategy:

    state = hvdcomp.ddp.HookState(model, compression="alq:bits=3")
    DDPStrategy(ddp_comm_state=state, ddp_comm_hook=hvdcomp.ddp.hook)

(the state sets itself up on the first hook call, once Lightning has started the process
group; a compressor that applies momentum itself, DGC, also needs
``state.attach_optimizer(optimizer)`` in ``configure_optimizers``).  On GPUs that is all.
On CPUs, Lightning 2.6's DDPStrategy drops ``ddp_comm_hook`` without a word (it registers
hooks on CUDA only): :class:`HookedDDPStrategy` below registers it there too, and the script
refuses to report a run in which the hook never ran.  Lightning starts the other processes
itself; rank 0 prints the test accuracy on the 1,000 test digits, the bytes each rank sent
and the compression ratio against fp32.
"""
import argparse
import json
import math
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mnist import FC300100, load_digits  # noqa: E402

import pytorch_lightning as pl  # noqa: E402
from pytorch_lightning.strategies import DDPStrategy  # noqa: E402

import hvdcomp.ddp  # noqa: E402


class HookedDDPStrategy(DDPStrategy):
    """DDPStrategy that registers the communication hook on CPU (Gloo) as well as on CUDA."""

    def _register_ddp_hooks(self) -> None:
        if self.root_device.type == "cuda" or self._ddp_comm_hook is None:
            return super()._register_ddp_hooks()
        hook = self._ddp_comm_hook
        if self._ddp_comm_wrapper is not None:
            hook = self._ddp_comm_wrapper(hook)
        self.model.register_comm_hook(self._ddp_comm_state, hook)


class Classifier(pl.LightningModule):
    """FC-300-100 with SGD + momentum and a cosine learning rate, as in train_mnist.py."""

    def __init__(self, state: hvdcomp.ddp.HookState, net: FC300100, lr: float,
                 momentum: float, total_steps: int):
        super().__init__()
        self.net, self.state = net, state
        self.lr, self.momentum, self.total = lr, momentum, total_steps
        self.sent = self.fp32 = 0
        self.losses = []                        # [this process's loss, the synced one]

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, _):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        # the loss averaged over the processes (an all-reduce on the default group, in
        # every step next to hvdcomp's exchange)
        self.log("train_loss", loss, sync_dist=True)
        self.losses.append([loss.item(), None])
        return loss

    def on_train_batch_end(self, *_):
        self.losses[-1][1] = self.trainer.callback_metrics["train_loss"].item()
        st = self.state.last_stats              # this step's exchange, over by now
        if st is not None:                      # (None: the hook never ran; refused below)
            self.sent += st.bytes_sent
            self.fp32 += st.fp32_bytes

    def validation_step(self, batch, _):
        self._accuracy("val_acc", batch)

    def test_step(self, batch, _):
        self._accuracy("test_acc", batch)

    def _accuracy(self, name, batch):
        x, y = batch             # (equal batches: the mean over batches and processes is the
        self.log(name, (self(x).argmax(1) == y).float().mean() * 100, sync_dist=True)  # mean)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)
        self.state.attach_optimizer(opt)        # DGC: the hook applies its momentum
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda t: 0.5 * (1 + math.cos(math.pi * min(t, self.total) / self.total)))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compression", default="alq:bits=3")
    ap.add_argument("--devices", type=int, default=2, help="CPU processes")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=32, help="per process")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="", help="write the results here (rank 0)")
    args = ap.parse_args(argv)

    torch.set_num_threads(1)
    pl.seed_everything(args.seed, verbose=False)
    x_tr, y_tr, x_te, y_te = load_digits(args.seed)
    net = FC300100()
    state = hvdcomp.ddp.HookState(net, compression=args.compression, seed=args.seed)
    steps_per_epoch = math.ceil(len(x_tr) / args.devices / args.batch_size)
    model = Classifier(state, net, args.lr, args.momentum, args.epochs * steps_per_epoch)
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, max_epochs=args.epochs,
        strategy=HookedDDPStrategy(ddp_comm_state=state, ddp_comm_hook=hvdcomp.ddp.hook,
                                   process_group_backend="gloo"),
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False)
    loader = DataLoader(TensorDataset(x_tr, y_tr), batch_size=args.batch_size, shuffle=True)
    trainer.fit(model, loader)
    # evaluation after fit with the same trainer and state: no gradients, so no exchange
    # (the hook's step stays), and Lightning's sync_dist all-reduce still works
    steps_after_fit = state.step
    tests = DataLoader(TensorDataset(x_te, y_te), batch_size=100)
    val = trainer.validate(model, tests, verbose=False)[0]["val_acc"]
    tst = trainer.test(model, tests, verbose=False)[0]["test_acc"]
    if state.step != steps_after_fit:
        raise RuntimeError(f"validate/test ran hvdcomp's exchange: step {steps_after_fit} -> "
                           f"{state.step}")

    # every rank's bytes and exchanges (the process group is still up after fit)
    mine = [state.step, model.sent, model.fp32, model.losses]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if any(e[0] != trainer.global_step for e in every):
        raise RuntimeError(f"hvdcomp's hook ran {[e[0] for e in every]} times per rank for "
                           f"{trainer.global_step} optimizer steps: was it registered?")
    # Lightning's sync_dist gave every step the mean of the processes' losses
    synced = 0
    for k, (_, got) in enumerate(model.losses):
        want = sum(e[3][k][0] for e in every) / len(every)
        if abs(got - want) > 1e-6 * (1 + abs(want)):
            raise RuntimeError(f"step {k}: sync_dist gave {got}, the processes' mean loss "
                               f"is {want}")
        synced += 1
    if trainer.global_rank == 0:
        with torch.no_grad():
            acc = (net(x_te).argmax(1) == y_te).float().mean().item() * 100
        sent = max(e[1] for e in every)
        res = {"compression": state.compression.spec(), "world_size": len(every),
               "steps": trainer.global_step, "hook_steps": [e[0] for e in every],
               "test_acc": acc, "bytes_per_rank": sent, "fp32_bytes": model.fp32,
               "ratio": model.fp32 / sent, "sync_dist_steps": synced,
               "validate_acc": val, "test_acc_lightning": tst}
        print(f"lightning + hvdcomp.ddp: {len(every)} processes, {trainer.global_step} "
              f"steps, test acc {acc:.2f} %, sent/rank {sent / 1e6:.3f} MB, fp32 "
              f"{model.fp32 / 1e6:.3f} MB, ratio {res['ratio']:.2f}x, compression "
              f"{res['compression']}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
    state.close()


if __name__ == "__main__":
    main()

"""PyTorch DDP (gloo, env://) training the model of an llm.c file: the peer
of tests/worker/strategy/ddp_peer_test.cc. Run one process per rank under
`launch --standalone --nproc_per_node=N --no_python /usr/bin/python3 -u
torch_ddp_peer.py ...` (or torchrun).

Usage: torch_ddp_peer.py MODEL BATCH_DIR OUT --steps S --lr LR
           [--beta1 B1 --beta2 B2 --eps E --weight_decay WD --grad_clip G]
  MODEL      llm.c model file (version 3, fp32), as tests/worker/model/torch_reference.py
  BATCH_DIR  batch.<step>.<rank>.bin for step 0..S-1: int32 B, T, inputs (B*T),
             targets (B*T), the rank's samples of that step
  OUT        rank 0 writes one line per step: "<step> <loss>", step 1-based,
             loss the mean over ranks of each rank's mean cross-entropy

The model is torch_reference.py's GPT-2 (imported, not copied) in float32.
One optimizer step is muster's (worker/trainer/trainer.cc): DDP's gradient mean,
global-norm clip with the norm in float64 and scale max/norm when
norm > max (no +1e-6, unlike clip_grad_norm_), then AdamW with decoupled
decay on the matrices only (wte, qkvw, attprojw, fcw, fcprojw) and the
learning rate LR for every step (the test passes the schedule's value).
"""
import argparse
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

# torch_reference.py is in ../model/ from this file (tests/worker/model/,
# also in Bazel's runfiles).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "model"))
import torch_reference  # noqa: E402

DECAYED = {"wte", "qkvw", "attprojw", "fcw", "fcprojw"}  # TensorView::decay


class LlmcGpt(torch.nn.Module):
    """torch_reference's functional GPT-2 over float32 parameters."""

    def __init__(self, config, float64_params):
        super().__init__()
        self.config = config
        # float32 -> float64 -> float32 is exact: these are the file's values.
        self.weights = torch.nn.ParameterDict(
            {name: torch.nn.Parameter(p.detach().float()) for name, p in float64_params.items()})

    def forward(self, inputs, targets):
        return torch_reference.loss_of(self.config, self.weights, inputs, targets)


def read_batch(path):
    batch = np.fromfile(path, dtype="<i4")
    batch_size, time = int(batch[0]), int(batch[1])
    if batch.size != 2 + 2 * batch_size * time:
        sys.exit(f"{path}: {batch.size} int32, expected {2 + 2 * batch_size * time}")
    tokens = batch[2:].reshape(2, batch_size, time).astype(np.int64)
    return torch.from_numpy(tokens[0]), torch.from_numpy(tokens[1])


def clip_grad_norm(parameters, max_norm):
    """worker/optim/optim.cc ClipGradNorm: float64 norm, scale only above max_norm."""
    norm = sum(p.grad.double().pow(2).sum() for p in parameters).sqrt().item()
    if max_norm > 0 and norm > max_norm:
        for p in parameters:
            p.grad.mul_(float(np.float32(max_norm / norm)))
    return norm


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("batch_dir")
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--beta1", type=float, default=0.9)
    parser.add_argument("--beta2", type=float, default=0.95)
    parser.add_argument("--eps", type=float, default=1e-8)
    parser.add_argument("--weight_decay", type=float, default=0.0)
    parser.add_argument("--grad_clip", type=float, default=1.0)
    args = parser.parse_args()

    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    config, params, _ = torch_reference.read_model(args.model)
    module = LlmcGpt(config, params)
    model = torch.nn.parallel.DistributedDataParallel(module)
    named = dict(module.weights.items())
    groups = [
        {"params": [p for n, p in named.items() if n in DECAYED],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in named.items() if n not in DECAYED], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(args.beta1, args.beta2),
                                  eps=args.eps)
    losses = []
    for step in range(args.steps):
        inputs, targets = read_batch(os.path.join(args.batch_dir, f"batch.{step}.{rank}.bin"))
        loss = model(inputs, targets)
        loss.backward()  # DDP leaves the mean over ranks in every .grad
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        losses.append(mean_loss.item() / world)
        clip_grad_norm(list(named.values()), args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    if rank == 0:
        with open(args.out, "w") as out:
            for step, loss in enumerate(losses):
                out.write(f"{step + 1} {loss:.9g}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""An unmodified PyTorch DDP script: gloo, init_method="env://".

Run under `launch`, it proves torchrun's environment contract: rank 0 hosts
the TCPStore on MASTER_ADDR:MASTER_PORT, every rank finds it, and one
all-reduce plus one DDP backward pass involve every rank.
Usage: ddp_allreduce.py OUT_DIR
"""
import os
import sys

import torch
import torch.distributed as dist


def main():
    out_dir = sys.argv[1]
    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    world = dist.get_world_size()
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    model(torch.full((3, 4), float(rank))).sum().backward()
    grad_sum = model.module.weight.grad.sum().item()
    with open(os.path.join(out_dir, f"result.{rank}"), "w") as out:
        out.write(f"{world} {value.item():.1f} {grad_sum:.4f} {os.environ['LOCAL_RANK']}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

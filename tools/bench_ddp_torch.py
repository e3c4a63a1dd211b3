"""The PyTorch side of tools/bench_ddp: DistributedDataParallel (gloo,
env://) over tools/bench_train_torch.py's GPT-2 (llm.c's layout), AdamW and
clipping as there, random tokens (a different stream per rank). Run one
process per rank under `launch --standalone --nproc_per_node=N --no_python
/usr/bin/python3 bench_ddp_torch.py ...`.

Rank 0 writes OUT: `tokens_per_s <global tok/s> ms_per_step <ms> steps <n>`
over the steps after --warmup; global tokens are world * batch * seq.
"""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

# bench_train_torch.py sits next to this file (also in Bazel's runfiles).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_train_torch import Gpt  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    for name, default in [("layers", 4), ("dim", 256), ("heads", 4), ("vocab", 256),
                          ("seq", 128), ("batch", 8), ("steps", 10), ("warmup", 2)]:
        parser.add_argument("--" + name, type=int, default=default)
    parser.add_argument("--bucket_mb", type=float, default=25.0)  # DDP's default too
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1337)  # DDP broadcasts rank 0's weights anyway
    model = torch.nn.parallel.DistributedDataParallel(
        Gpt(args.layers, args.dim, args.heads, args.vocab, args.seq),
        bucket_cap_mb=args.bucket_mb)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95),
                                  weight_decay=0.0)
    generator = torch.Generator().manual_seed(1000 + rank)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=generator)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def step():
        optimizer.zero_grad(set_to_none=False)
        loss = model(inputs, targets)
        loss.backward()  # DDP averages the gradients, bucket by bucket, during backward
        dist.all_reduce(loss.detach())  # the logged mean loss, as our worker's loss all-reduce
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    for _ in range(args.warmup):
        step()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    seconds = (time.perf_counter() - start) / args.steps
    if rank == 0:
        with open(args.out, "w") as out:
            out.write("tokens_per_s %.1f ms_per_step %.3f steps %d\n" %
                      (world * args.batch * args.seq / seconds, seconds * 1e3, args.steps))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

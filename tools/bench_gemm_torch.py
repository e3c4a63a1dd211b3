"""PyTorch's peer of tools/bench_gemm: each GEMM of the list as torch.matmul
runs it in bf16 (PyTorch's own cuBLAS call and algorithm choice), at the
same m, n, k and operand layouts, timed with CUDA events, the median over
rounds. A pure GEMM with a bf16 result: no bias, GELU or DGELU epilogue and
no fp32 accumulation, which the engine's calls may add.

Each --gemm is one cuBLAS column-major call, "m,n,k,trans_a,trans_b"
(D (m, n) = op(A) op(B)); in row-major terms that is D^T (n, m) =
op(B)^T (n, k) @ op(A)^T (k, m), each operand a contiguous tensor or the
transposed view of one, as the flags say. Prints (tools/bench_gemm reads
these lines and skips any others):

  torch <version> on <device>
  gemm=<index> ms=<ms per call>
"""
import argparse
import statistics

import torch


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--gemm", action="append", default=[])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    dev = torch.device("cuda")
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name(dev)}", flush=True)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for index, spec in enumerate(args.gemm):
        m, n, k, trans_a, trans_b = (int(x) for x in spec.split(","))
        # op(A)^T (k, m): A stored (m x k) column-major is row-major (k, m);
        # stored (k x m), transposed, it is row-major (m, k), seen transposed.
        a = torch.randn((m, k) if trans_a else (k, m), device=dev, dtype=torch.bfloat16)
        a = a.t() if trans_a else a
        b = torch.randn((k, n) if trans_b else (n, k), device=dev, dtype=torch.bfloat16)
        b = b.t() if trans_b else b
        torch.matmul(b, a)
        torch.cuda.synchronize()
        per_call = []
        for _ in range(args.rounds):
            start.record()
            for _ in range(args.iters):
                torch.matmul(b, a)
            stop.record()
            stop.synchronize()
            per_call.append(start.elapsed_time(stop) / args.iters)
        print(f"gemm={index} ms={statistics.median(per_call):.5f}", flush=True)


if __name__ == "__main__":
    main()

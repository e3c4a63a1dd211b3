"""PyTorch's peer of tools/bench_flash: scaled_dot_product_attention with
is_causal=True in bf16 at the same shape (B, NH, T, 64), forward alone and
backward alone (the gradients of q, k and v from a given dout), timed with
CUDA events, the median over rounds. Prints one line:

  torch <version> on <device>: backend <name>
  forward_ms=<ms> backward_ms=<ms>
"""
import argparse
import statistics

import torch
import torch.nn.functional as F


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    dev = torch.device("cuda")
    shape = (args.batch, args.heads, args.seq, 64)
    q, k, v = (torch.randn(shape, device=dev, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn(shape, device=dev, dtype=torch.bfloat16)
    backend = "default"
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        context = sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                               SDPBackend.EFFICIENT_ATTENTION])
        backend = "flash, cuDNN or efficient (PyTorch's choice)"
    except ImportError:
        import contextlib
        context = contextlib.nullcontext()

    def timed(fn):
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.iters):
            fn()
        stop.record()
        torch.cuda.synchronize()
        return start.elapsed_time(stop) / args.iters

    with context:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        forward_ms, backward_ms = [], []

        def forward():
            with torch.no_grad():
                F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def backward():
            torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

        forward()
        backward()
        torch.cuda.synchronize()
        for _ in range(args.rounds):
            forward_ms.append(timed(forward))
            backward_ms.append(timed(backward))
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}: backend {backend}")
    print(f"forward_ms={statistics.median(forward_ms):.4f} "
          f"backward_ms={statistics.median(backward_ms):.4f}")


if __name__ == "__main__":
    main()

"""PyTorch's peer of tools/bench_flash: scaled_dot_product_attention with
is_causal=True in bf16 (or --dtype float32, with TF32 matmuls allowed as
PyTorch's tf32 training step has them: the peer of muster's tf32 kernels)
at the same shape (B, NH, T, 64), forward alone and
backward alone (the gradients of q, k and v from a given dout), timed with
CUDA events, the median over rounds. Timed under PyTorch's own choice among
its flash, cuDNN and memory-efficient kernels ("default"), then under each
of them alone (torch.nn.attention.sdpa_kernel), all in the same rounds, the
order reversed every other round. A backend this PyTorch or GPU does not
offer is reported and skipped. Prints (tools/bench_flash reads these lines,
and skips any others, such as PyTorch's warnings):

  torch <version> on <device>
  sdpa=<backend> kernel=<kernel> forward_ms=<ms> backward_ms=<ms>
  sdpa=<backend> unavailable: <why>

one sdpa= line per backend (default, flash, cudnn, efficient), where
<kernel> is the one whose autograd node the forward with gradients recorded
(flash, cudnn, efficient, math, or that node's name): the backward's
kernel, and the forward's unless PyTorch chooses otherwise under no_grad.
"""
import argparse
import contextlib
import statistics
import warnings

import torch
import torch.nn.functional as F

# The backends timed alone: (name in the output, SDPBackend member).
BACKENDS = [("flash", "FLASH_ATTENTION"), ("cudnn", "CUDNN_ATTENTION"),
            ("efficient", "EFFICIENT_ATTENTION")]


def kernel_of(out):
    """The kernel that computed `out`, from the autograd node it recorded
    (ScaledDotProductFlashAttentionBackward0 and the like)."""
    node = out.grad_fn.name() if out.grad_fn is not None else "none"
    for key, name in (("Flash", "flash"), ("Cudnn", "cudnn"), ("Efficient", "efficient"),
                      ("Math", "math")):
        if key in node:
            return name
    return node


def one_line(text):
    return " ".join(str(text).split()) or "no message"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = parser.parse_args()
    dev = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    if dtype == torch.float32:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    shape = (args.batch, args.heads, args.seq, 64)
    q, k, v = (torch.randn(shape, device=dev, dtype=dtype, requires_grad=True)
               for _ in range(3))
    dout = torch.randn(shape, device=dev, dtype=dtype)

    # (name, a function making the context that selects the backend), or
    # the reason it cannot be selected.
    candidates = []
    unavailable = {}
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError as e:
        # An old PyTorch: its default choice alone.
        candidates.append(("default", contextlib.nullcontext))
        for name, _ in BACKENDS:
            unavailable[name] = f"torch.nn.attention.sdpa_kernel missing ({one_line(e)})"
    else:
        members = [getattr(SDPBackend, m) for _, m in BACKENDS if hasattr(SDPBackend, m)]
        candidates.append(("default", lambda: sdpa_kernel(members)))
        for name, member in BACKENDS:
            if not hasattr(SDPBackend, member):
                unavailable[name] = f"SDPBackend.{member} missing in this PyTorch"
                continue
            candidates.append((name, lambda m=getattr(SDPBackend, member): sdpa_kernel([m])))

    def timed(fn):
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.iters):
            fn()
        stop.record()
        torch.cuda.synchronize()
        return start.elapsed_time(stop) / args.iters

    def forward():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=True)

    # Each backend's output with its graph (the backward it recorded), and
    # a first forward and backward: a backend that cannot run this shape
    # fails here, each on its own.
    runs = []
    for name, context in candidates:
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with context():
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                    forward()
                torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
                torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001: any failure skips the backend
            why = one_line(e)
            reasons = [one_line(w.message) for w in caught]
            if reasons:
                why += " [" + "; ".join(reasons[:3]) + "]"
            unavailable[name] = why
            continue
        runs.append({"name": name, "context": context, "out": out, "kernel": kernel_of(out),
                     "forward_ms": [], "backward_ms": []})

    for r in range(args.rounds):
        for run in (runs if r % 2 == 0 else runs[::-1]):
            out = run["out"]
            with run["context"]():
                run["forward_ms"].append(timed(forward))
            run["backward_ms"].append(
                timed(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)))

    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}, {args.dtype}")
    timed_runs = {run["name"]: run for run in runs}
    for name in ["default"] + [n for n, _ in BACKENDS]:
        if name in timed_runs:
            run = timed_runs[name]
            print(f"sdpa={name} kernel={run['kernel']} "
                  f"forward_ms={statistics.median(run['forward_ms']):.4f} "
                  f"backward_ms={statistics.median(run['backward_ms']):.4f}")
        else:
            print(f"sdpa={name} unavailable: {unavailable.get(name, 'not timed')}")


if __name__ == "__main__":
    main()

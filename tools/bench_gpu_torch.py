"""The PyTorch side of tools/bench_gpu: GPT-2 124M as muster's worker builds
it (llm.c's layout: tied wte / LM head, learned wpe, pre-LayerNorm blocks,
LayerNorm with bias, tanh GELU, biases on every linear but the head,
vocabulary padded to a multiple of 128 for the embedding and head with the
loss over the first V logits, N(0, 0.02) init with the residual projections
scaled by 1/sqrt(2L)) trained on random tokens with AdamW, one mode at a
time:

  fp32          fp32 weights and math, TF32 off
  tf32          fp32 weights, TF32 matmuls and convolutions
  bf16          autocast to bf16, fp32 weights (TF32 on for what stays fp32)
  bf16_compile  bf16 with torch.compile(model)

A step is forward, loss.backward(), clip_grad_norm_(1.0), AdamW (lr 3e-4,
betas (0.9, 0.95), eps 1e-8, no weight decay, fused on CUDA), then
zero_grad(set_to_none=True). Each step is timed with CUDA events (the host
clock on the CPU) after the warm-up steps; the median is reported.

Prints one JSON line first, {"torch": version, "device": name}, then one per
mode: {"mode", "ms_per_step", "tok_per_s", "peak_gb", "loss", ...}, or
{"mode", "error"} when the mode failed (the run goes on to the next mode).

  python3 tools/bench_gpu_torch.py --device cuda --batch 8 --seq 1024 --modes bf16,fp32
  python3 tools/bench_gpu_torch.py --device cpu --tiny --steps 2 --warmup 1 --modes fp32
"""
import argparse
import gc
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

DEFAULT_MODES = "bf16,bf16_compile,tf32,fp32"
ALL_MODES = ("fp32", "tf32", "bf16", "bf16_compile")


class Block(nn.Module):
    def __init__(self, C, NH, maxT):
        super().__init__()
        self.NH = NH
        self.ln1 = nn.LayerNorm(C)
        self.qkv = nn.Linear(C, 3 * C)
        self.attproj = nn.Linear(C, C)
        self.ln2 = nn.LayerNorm(C)
        self.fc = nn.Linear(C, 4 * C)
        self.fcproj = nn.Linear(4 * C, C)
        self.sdpa = hasattr(F, "scaled_dot_product_attention")
        if not self.sdpa:  # torch < 2.0
            mask = torch.ones(maxT, maxT, dtype=torch.bool).tril()
            self.register_buffer("mask", mask.view(1, 1, maxT, maxT), persistent=False)

    def attention(self, q, k, v):
        if self.sdpa:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        T = q.size(-2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))
        att = att.masked_fill(~self.mask[:, :, :T, :T], float("-inf")).softmax(dim=-1)
        return att @ v

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        # (B, NH, T, hs)
        q, k, v = (t.view(B, T, self.NH, C // self.NH).transpose(1, 2) for t in (q, k, v))
        y = self.attention(q, k, v).transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.attproj(y)
        return x + self.fcproj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class Gpt(nn.Module):
    def __init__(self, L, C, NH, V, maxT):
        super().__init__()
        self.V = V
        Vp = (V + 127) // 128 * 128  # 50257 -> 50304, as llm.c
        self.wte = nn.Embedding(Vp, C)
        self.wpe = nn.Embedding(maxT, C)
        self.blocks = nn.ModuleList(Block(C, NH, maxT) for _ in range(L))
        self.lnf = nn.LayerNorm(C)
        self.head = nn.Linear(C, Vp, bias=False)
        self.head.weight = self.wte.weight  # tied
        self.init_weights(L)

    def init_weights(self, L):
        residual_std = 0.02 / math.sqrt(2 * L)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                if module is self.head:
                    continue  # the tied wte, initialised as an embedding
                std = residual_std if name.endswith(("attproj", "fcproj")) else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets):
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.lnf(x))[..., : self.V]  # (B, T, V)
        return F.cross_entropy(logits.reshape(-1, self.V).float(), targets.reshape(-1))


def make_optimizer(model, device):
    kwargs = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    if device.type == "cuda":
        try:
            return torch.optim.AdamW(model.parameters(), fused=True, **kwargs), "fused"
        except (TypeError, RuntimeError, ValueError):  # torch < 2.0 has no fused AdamW
            try:
                return torch.optim.AdamW(model.parameters(), foreach=True, **kwargs), "foreach"
            except TypeError:
                pass
    return torch.optim.AdamW(model.parameters(), **kwargs), "default"


def set_tf32(enabled):
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_mode(mode, args, cfg, device):
    """Trains for warm-up + timed steps in `mode`; returns the JSON dict."""
    L, C, NH, V, B, T = cfg
    set_tf32(mode != "fp32")
    autocast = mode.startswith("bf16")
    if mode == "bf16_compile" and not hasattr(torch, "compile"):
        raise RuntimeError("torch.compile needs torch >= 2.0 (this is %s)" % torch.__version__)
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)

    torch.manual_seed(1337)
    model = Gpt(L, C, NH, V, T).to(device)
    optimizer, optimizer_kind = make_optimizer(model, device)
    forward = torch.compile(model) if mode == "bf16_compile" else model
    generator = torch.Generator(device="cpu").manual_seed(42)
    tokens = torch.randint(0, V, (B, T + 1), generator=generator).to(device)
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def step():
        if autocast:
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
                loss = forward(inputs, targets)
        else:
            loss = forward(inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    warmup = max(args.warmup, 3) if mode == "bf16_compile" else args.warmup
    first_loss = None
    for _ in range(warmup):
        loss = step()
        if first_loss is None:
            first_loss = loss.item()
    synchronize(device)

    losses, ms = [], []
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(args.steps)]
        for start, end in events:
            start.record()
            losses.append(step())
            end.record()
        torch.cuda.synchronize(device)
        ms = [start.elapsed_time(end) for start, end in events]
    else:
        for _ in range(args.steps):
            start = time.perf_counter()
            losses.append(step())
            ms.append((time.perf_counter() - start) * 1e3)
    losses = [loss.item() for loss in losses]
    if first_loss is None:
        first_loss = losses[0]
    bad = [i for i, loss in enumerate(losses) if not math.isfinite(loss)]
    if bad or not math.isfinite(first_loss):
        raise RuntimeError("loss is not finite (timed step %s)" % (bad[0] if bad else "warm-up"))

    median = statistics.median(ms)
    peak_gb = (torch.cuda.max_memory_allocated(device) / 1e9
               if device.type == "cuda" else None)
    result = {
        "mode": mode,
        "ms_per_step": round(median, 3),
        "tok_per_s": round(B * T / (median / 1e3), 1),
        "peak_gb": None if peak_gb is None else round(peak_gb, 3),
        "loss": round(losses[-1], 5),
        "first_loss": round(first_loss, 5),
        "min_ms": round(min(ms), 3),
        "max_ms": round(max(ms), 3),
        "batch": B,
        "seq": T,
        "steps": args.steps,
        "warmup": warmup,
        "optimizer": optimizer_kind,
    }
    del forward, model, optimizer, inputs, targets, tokens
    return result


def cleanup(device):
    if hasattr(torch, "_dynamo"):
        torch._dynamo.reset()  # drop compiled graphs and their memory
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def emit(obj):
    print(json.dumps(obj), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda | cpu")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--modes", default=os.environ.get("BENCH_GPU_TORCH_MODES", DEFAULT_MODES),
                        help="comma-separated, of %s (default: $BENCH_GPU_TORCH_MODES or %s)"
                        % (", ".join(ALL_MODES), DEFAULT_MODES))
    parser.add_argument("--tiny", action="store_true",
                        help="L=2 C=64 NH=2 V=256 T=32 B=2, for a smoke test")
    args = parser.parse_args()
    if args.steps <= 0 or args.warmup < 0:
        parser.error("--steps must be > 0 and --warmup >= 0")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in ALL_MODES]
    if unknown:
        parser.error("unknown mode(s) %s; known: %s" % (", ".join(unknown), ", ".join(ALL_MODES)))

    if args.tiny:
        cfg = (2, 64, 2, 256, 2, 32)
    else:
        cfg = (12, 768, 12, 50257, args.batch, args.seq)

    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print("bench_gpu_torch: torch %s sees no CUDA device" % torch.__version__,
                  file=sys.stderr)
            return 1
        name = torch.cuda.get_device_name(device)
    else:
        name = "cpu (%d threads)" % torch.get_num_threads()
    emit({"torch": torch.__version__, "device": name})

    for mode in modes:
        try:
            emit(run_mode(mode, args, cfg, device))
        except Exception as error:  # OOM, compile failure, ...: report, go on
            message = "%s: %s" % (type(error).__name__, str(error).strip().split("\n")[0])
            emit({"mode": mode, "error": message[:500]})
        cleanup(device)
    return 0


if __name__ == "__main__":
    sys.exit(main())

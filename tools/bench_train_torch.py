"""The PyTorch side of tools/bench_train: the same GPT-2 (llm.c's layout:
pre-LayerNorm blocks, tanh GELU, tied LM head, vocabulary padded to a
multiple of 128) trained with AdamW on random tokens, on the CPU, for the
same steps. Prints one line: `torch ms_per_step <ms> tokens_per_s <tok/s>`.
"""
import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, C, NH):
        super().__init__()
        self.NH = NH
        self.ln1 = nn.LayerNorm(C)
        self.qkv = nn.Linear(C, 3 * C)
        self.attproj = nn.Linear(C, C)
        self.ln2 = nn.LayerNorm(C)
        self.fc = nn.Linear(C, 4 * C)
        self.fcproj = nn.Linear(4 * C, C)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        # (B, NH, T, hs)
        q, k, v = (t.view(B, T, self.NH, C // self.NH).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(C // self.NH)
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.attproj(y)
        return x + self.fcproj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class Gpt(nn.Module):
    def __init__(self, L, C, NH, V, maxT):
        super().__init__()
        Vp = (V + 127) // 128 * 128
        self.V = V
        self.wte = nn.Embedding(Vp, C)
        self.wpe = nn.Embedding(maxT, C)
        self.blocks = nn.ModuleList(Block(C, NH) for _ in range(L))
        self.lnf = nn.LayerNorm(C)

    def forward(self, idx, targets):
        B, T = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(T))
        for block in self.blocks:
            x = block(x)
        logits = self.lnf(x) @ self.wte.weight.t()  # (B, T, Vp), tied head
        logits = logits[..., : self.V]
        return F.cross_entropy(logits.reshape(-1, self.V), targets.reshape(-1))


def main():
    parser = argparse.ArgumentParser()
    for name, default in [("layers", 4), ("dim", 256), ("heads", 4), ("vocab", 256),
                          ("seq", 128), ("batch", 8), ("steps", 10), ("warmup", 2),
                          ("threads", 0)]:
        parser.add_argument("--" + name, type=int, default=default)
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(1337)
    model = Gpt(args.layers, args.dim, args.heads, args.vocab, args.seq)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95),
                                  weight_decay=0.0)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def step():
        loss = model(inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    for _ in range(args.warmup):
        step()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    seconds = (time.perf_counter() - start) / args.steps
    print("torch ms_per_step %.3f tokens_per_s %.1f threads %d" %
          (seconds * 1e3, args.batch * args.seq / seconds, torch.get_num_threads()))


if __name__ == "__main__":
    main()

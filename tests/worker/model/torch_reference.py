"""GPT-2 in plain PyTorch (float64), the independent reference for
tests/worker/model/model_reference_test.cc.

Usage: torch_reference.py MODEL BATCH OUT_DIR
  MODEL   llm.c model file (version 3, fp32): 256 int32 header, then the
          parameters tensor-major (wte, wpe, ln1w[L], ln1b[L], ...).
  BATCH   int32 little-endian: B, T, then inputs (B*T), then targets (B*T).
Writes, little-endian float64:
  OUT_DIR/loss.bin   the mean cross-entropy over B*T positions (1 value)
  OUT_DIR/grads.bin  d loss / d every parameter, in the model file's order
Nothing here is shared with the C++ model: autograd differentiates it.
"""
import math
import os
import sys

import numpy as np
import torch

HEADER_INTS = 256
MAGIC = 20240326


def read_model(path):
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    if header[0] != MAGIC or header[1] != 3:
        sys.exit(f"{path}: not an llm.c fp32 model file")
    max_t, vocab, layers, heads, dim, padded_vocab = (int(x) for x in header[2:8])
    values = np.fromfile(path, dtype="<f4", offset=4 * HEADER_INTS)
    shapes = [("wte", (padded_vocab, dim)), ("wpe", (max_t, dim))]
    for name, shape in [("ln1w", (dim,)), ("ln1b", (dim,)),
                        ("qkvw", (3 * dim, dim)), ("qkvb", (3 * dim,)),
                        ("attprojw", (dim, dim)), ("attprojb", (dim,)),
                        ("ln2w", (dim,)), ("ln2b", (dim,)),
                        ("fcw", (4 * dim, dim)), ("fcb", (4 * dim,)),
                        ("fcprojw", (dim, 4 * dim)), ("fcprojb", (dim,))]:
        shapes.append((name, (layers,) + shape))
    shapes += [("lnfw", (dim,)), ("lnfb", (dim,))]
    params, offset = {}, 0
    for name, shape in shapes:
        count = math.prod(shape)
        chunk = values[offset:offset + count].astype(np.float64).reshape(shape)
        params[name] = torch.tensor(chunk, dtype=torch.float64, requires_grad=True)
        offset += count
    if offset != values.size:
        sys.exit(f"{path}: {values.size} floats, expected {offset}")
    config = dict(vocab=vocab, layers=layers, heads=heads, dim=dim)
    return config, params, [name for name, _ in shapes]


def layer_norm(x, weight, bias):
    mean = x.mean(dim=-1, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=-1, keepdim=True)  # biased, as GPT-2
    return (x - mean) / torch.sqrt(var + 1e-5) * weight + bias


def gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def causal_attention(qkv, heads):
    batch, time, three_dim = qkv.shape
    dim = three_dim // 3
    head_size = dim // heads
    q, k, v = qkv.split(dim, dim=-1)
    # (B, T, C) -> (B, NH, T, hs)
    q, k, v = (t.view(batch, time, heads, head_size).transpose(1, 2) for t in (q, k, v))
    scores = q @ k.transpose(-2, -1) / math.sqrt(head_size)
    future = torch.triu(torch.ones(time, time, dtype=torch.bool), diagonal=1)
    scores = scores.masked_fill(future, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v
    return out.transpose(1, 2).reshape(batch, time, dim)


def loss_of(config, p, inputs, targets):
    time = inputs.shape[1]
    x = p["wte"][inputs] + p["wpe"][:time]
    for l in range(config["layers"]):
        h = layer_norm(x, p["ln1w"][l], p["ln1b"][l])
        qkv = h @ p["qkvw"][l].T + p["qkvb"][l]
        x = x + causal_attention(qkv, config["heads"]) @ p["attprojw"][l].T + p["attprojb"][l]
        h = layer_norm(x, p["ln2w"][l], p["ln2b"][l])
        h = gelu_tanh(h @ p["fcw"][l].T + p["fcb"][l])
        x = x + h @ p["fcprojw"][l].T + p["fcprojb"][l]
    x = layer_norm(x, p["lnfw"], p["lnfb"])
    logits = x @ p["wte"].T  # (B, T, Vp): the head is wte, tied
    real = logits[..., :config["vocab"]]  # padded logits are not part of the softmax
    return torch.nn.functional.cross_entropy(real.reshape(-1, config["vocab"]),
                                             targets.reshape(-1))


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    model_path, batch_path, out_dir = sys.argv[1:]
    config, params, order = read_model(model_path)
    batch = np.fromfile(batch_path, dtype="<i4")
    batch_size, time = int(batch[0]), int(batch[1])
    tokens = batch[2:].reshape(2, batch_size, time).astype(np.int64)
    inputs, targets = torch.from_numpy(tokens[0]), torch.from_numpy(tokens[1])
    loss = loss_of(config, params, inputs, targets)
    loss.backward()
    np.array([loss.item()], dtype="<f8").tofile(os.path.join(out_dir, "loss.bin"))
    grads = np.concatenate([params[name].grad.numpy().reshape(-1) for name in order])
    grads.astype("<f8").tofile(os.path.join(out_dir, "grads.bin"))


if __name__ == "__main__":
    main()

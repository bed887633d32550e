"""PyTorch eager bf16 baseline for the GPU checklist: GPT-2 small (124M) training steps on one GPU.

The same model as schedules/models/gpt2.sched (learned positions, pre-LayerNorm blocks, tanh
GELU, tied head, AdamW), in fp32 weights under bf16 autocast (PyTorch's usual mixed precision),
attention through scaled_dot_product_attention (flash attention where PyTorch has it), no
torch.compile. Prints one JSON line: step time, tokens/s and MFU by Megatron's formula (the one
runtime/tests/cuda.rs reports for schedrun) against the GPU's dense bf16 peak.
"""

import argparse
import json
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, h, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.ln2 = nn.LayerNorm(h)
        self.fc = nn.Linear(h, 4 * h)
        self.out = nn.Linear(4 * h, h)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=2)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT2(nn.Module):
    def __init__(self, vocab=50257, seq=1024, h=768, layers=12, heads=12):
        super().__init__()
        self.wte = nn.Embedding(vocab, h)
        self.wpe = nn.Embedding(seq, h)
        self.blocks = nn.ModuleList(Block(h, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(h)
        # GPT-2's initialisation of the tied embedding (nn.Embedding's default N(0, 1), used as
        # the head, starts the loss near 104 instead of ln(vocab) ≈ 10.8); timing is unaffected.
        nn.init.normal_(self.wte.weight, std=0.02)
        nn.init.normal_(self.wpe.weight, std=0.02)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.ln_f(x) @ self.wte.weight.t()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--peak-tflops", type=float, default=989.4, help="dense bf16 peak (H100 SXM)")
    a = ap.parse_args()
    torch.manual_seed(0)
    dev = "cuda"
    vocab, layers, h = 50257, 12, 768
    model = GPT2(vocab=vocab, seq=a.seq, h=h, layers=layers).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    data = torch.randint(0, vocab, (a.micro_batch, a.seq + 1), device=dev)
    x, y = data[:, :-1], data[:, 1:]

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, vocab), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    step()  # warm-up
    torch.cuda.synchronize()
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        loss = step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    t = sorted(times)[len(times) // 2]
    b, s = a.micro_batch, a.seq
    flops = 72 * b * s * layers * h * h * (1 + s / (6 * h) + vocab / (12 * layers * h))
    print(json.dumps({
        "system": "pytorch-eager-bf16",
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(),
        "step_s": t,
        "tokens_per_s": b * s / t,
        "tflops": flops / t / 1e12,
        "mfu": flops / t / (a.peak_tflops * 1e12),
        "loss": float(loss),
    }))


if __name__ == "__main__":
    main()

"""PyTorch reference for the cpu backend's throughput benchmark (bench/README.md).

Trains bench/small_gpt.sched's model -- 6 GPT-2 blocks of hidden 256, 4 heads, ffn 1024, learned positions,
tied head, byte vocabulary -- on a global batch of 16 sequences of 256 bytes, in one process, fp32, with AdamW
(betas 0.9/0.95, eps 1e-8, weight decay 0.1 on 2-D tensors), eager mode, scaled_dot_product_attention. It
prints one JSON object: the median step time and tokens/s over the timed steps.

    python3 bench/torch_step.py --threads 2 --steps 10
"""
import argparse
import json
import math
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, HIDDEN, HEADS, FFN, LAYERS, SEQ, SEQS = 256, 256, 4, 1024, 6, 256, 16


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(HIDDEN, eps=1e-5)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.ln2 = nn.LayerNorm(HIDDEN, eps=1e-5)
        self.fc = nn.Linear(HIDDEN, FFN)
        self.out = nn.Linear(FFN, HIDDEN)

    def forward(self, x):
        b, t, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(HIDDEN, dim=2)
        q, k, v = (y.view(b, t, HEADS, h // HEADS).transpose(1, 2) for y in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, h))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class Gpt(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, HIDDEN)
        self.wpe = nn.Embedding(SEQ, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln = nn.LayerNorm(HIDDEN, eps=1e-5)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * LAYERS) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1])
        x = self.wte(idx) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x)
        logits = self.ln(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = Gpt()
    decay = [p for p in model.parameters() if p.dim() == 2]
    other = [p for p in model.parameters() if p.dim() != 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
        lr=1e-3, betas=(0.9, 0.95), eps=1e-8,
    )
    data = torch.randint(0, VOCAB, (SEQS, SEQ + 1))
    x, y = data[:, :-1], data[:, 1:]
    times = []
    for step in range(args.warmup + args.steps):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        opt.step()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    t = statistics.median(times)
    print(json.dumps({
        "torch": torch.__version__, "threads": args.threads, "tokens_per_step": SEQS * SEQ,
        "step_time_s": t, "tokens_per_s": SEQS * SEQ / t, "loss": loss.item(),
    }))


if __name__ == "__main__":
    main()

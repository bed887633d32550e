#!/usr/bin/env python3
"""Parity of `schedrun --init` / `--save-hf` with Hugging Face `transformers` (issue 28, item 2).

Not run by CI or `cargo test` (PyTorch is not installed there); run it by hand where `torch` and
`transformers` are installed (CPU is enough), from the repository root, after `cargo build -p schedc
-p schedrun`:

    python3 runtime/tests/hf/parity.py [--bin target/debug]

For a tiny GPT-2 and a tiny LLaMA (GQA, untied head), each built from a config with random weights
and saved with `save_pretrained` (fp32, and bf16 for the loss check), nothing downloaded:

1. `schedc import hf config.json` gives a model whose parameter count (`schedc check`) is the
   checkpoint's `num_parameters()`;
2. `schedrun --init DIR --steps 1` (the loss is taken before the update) under ZeRO-3 on 4 CPU ranks gives the first-step loss
   `transformers` computes on the same tokens, within 1e-5 relative (fp32);
3. after 3 training steps, `--save-hf` writes weights that `from_pretrained` loads, and the loss of
   the loaded model on the same tokens equals schedrun's own loss from those weights within 1e-5
   (the logits agree through the loss: schedrun prints no logits).

The data file is seq_len + 2 bytes, so that every sequence of every step is the same window
(`runtime.md`, "Data and batches": sequence g starts at (g * seq_len) mod (len - seq_len - 1) = 0):
inputs bytes[0:seq_len], targets bytes[1:seq_len + 1].
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import torch
import transformers

SEQ = 64


def configs():
    gpt2 = transformers.GPT2Config(
        vocab_size=256, n_positions=SEQ, n_embd=64, n_layer=2, n_head=4, n_inner=256,
        activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        layer_norm_epsilon=1e-5, tie_word_embeddings=True)
    llama = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        rms_norm_eps=1e-6, rope_theta=50000.0, tie_word_embeddings=False, attention_dropout=0.0)
    return [("gpt2", gpt2, transformers.GPT2LMHeadModel),
            ("llama", llama, transformers.LlamaForCausalLM)]


def loss_of(model, window):
    ids = torch.tensor([window[:SEQ]])
    targets = torch.tensor(window[1:SEQ + 1])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()
    return torch.nn.functional.cross_entropy(logits, targets).item()


def run(cmd):
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)}:\n{out.stderr}")
    return out.stdout


def schedrun_losses(bin_dir, sched, data, init, extra):
    out = run([os.path.join(bin_dir, "schedrun"), sched, "--data", data, "--init", init,
               "--json"] + extra)
    return [json.loads(l)["loss"] for l in out.splitlines() if '"loss"' in l]


def close(a, b, what):
    rel = abs(a - b) / abs(b)
    print(f"  {what}: schedrun {a:.8f}  transformers {b:.8f}  relative {rel:.2e}")
    if rel > 1e-5:
        sys.exit(f"FAIL {what}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/debug")
    args = ap.parse_args()
    root = os.getcwd()
    tmp = tempfile.mkdtemp(prefix="sched-hf-parity-")
    torch.manual_seed(0)
    window = list(os.urandom(SEQ + 2))
    data = os.path.join(tmp, "window.bin")
    with open(data, "wb") as f:
        f.write(bytes(window))
    for name, config, cls in configs():
        print(name)
        model = cls(config).eval()
        ckpt = os.path.join(tmp, name)
        model.save_pretrained(ckpt, safe_serialization=True)
        # 1. The imported model's parameter count.
        block = os.path.join(tmp, f"{name}.sched")
        run([os.path.join(args.bin, "schedc"), "import", "hf", os.path.join(ckpt, "config.json"),
             "--name", "m", "-o", block])
        sched = os.path.join(tmp, f"{name}_run.sched")
        with open(sched, "w") as f:
            f.write(f'import "{block}"\nimport "{root}/schedules/clusters/cpu.sched"\n'
                    "schedule s { model = m  cluster = cpu4  nodes = 1  preset = zero3 }\n")
        check = run([os.path.join(args.bin, "schedc"), "check", sched])
        count = int(re.search(r"with ([\d,]+) parameters", check).group(1).replace(",", ""))
        print(f"  parameters: schedc {count}  transformers {model.num_parameters()}")
        assert count == model.num_parameters(), "parameter counts differ"
        # 2. The first step's loss (fp32 and bf16 checkpoints).
        got = schedrun_losses(args.bin, sched, data, ckpt, ["--steps", "1"])[0]
        close(got, loss_of(model, window), "first-step loss (fp32)")
        half = os.path.join(tmp, f"{name}-bf16")
        model.to(torch.bfloat16).save_pretrained(half, safe_serialization=True)
        model.float()
        rounded = cls.from_pretrained(half, torch_dtype=torch.float32).eval()
        got = schedrun_losses(args.bin, sched, data, half, ["--steps", "1"])[0]
        close(got, loss_of(rounded, window), "first-step loss (bf16 checkpoint)")
        # 3. Trained weights back into transformers.
        saved = os.path.join(tmp, f"{name}-trained")
        os.makedirs(saved)
        shutil.copy(os.path.join(ckpt, "config.json"), saved)
        schedrun_losses(args.bin, sched, data, ckpt,
                        ["--steps", "3", "--save-hf", os.path.join(saved, "model.safetensors")])
        trained = cls.from_pretrained(saved).eval()
        got = schedrun_losses(args.bin, sched, data, saved, ["--steps", "1"])[0]
        close(got, loss_of(trained, window), "loss after 3 steps, weights from --save-hf")
    shutil.rmtree(tmp)
    print("ok")


if __name__ == "__main__":
    main()

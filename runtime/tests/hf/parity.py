#!/usr/bin/env python3
"""Parity of `schedrun --init` / `--save-hf` with Hugging Face `transformers` (issue 28, item 2).

Run by `cargo test -p schedrun --test hf` where `python3 -c "import torch, transformers"` works
(`hf_parity_with_transformers`; elsewhere that test says SKIPPED). CI does not install PyTorch.
By hand, from the repository root, after `cargo build -p schedc -p schedrun` (CPU is enough):

    python3 runtime/tests/hf/parity.py [--bin target/debug]

For tiny GPT-2s (tied and untied head) and LLaMAs (GQA with an untied head and rotary base 50,000;
multi-query with a tied head), each built from a config with every parameter random and saved with
`save_pretrained` (fp32; also bf16, and fp32 in shards), nothing downloaded:

1. `schedc import hf config.json` gives a model whose parameter count (`schedc check`) is the
   checkpoint's `num_parameters()`;
2. `schedrun --init DIR --steps 1` (the loss is taken before the update) under ZeRO-3 on 4 CPU
   ranks gives the first-step loss `transformers` computes on the same tokens, within 1e-5
   relative (fp32), from the single file, the sharded index and the bf16 checkpoint (against
   `transformers` on the bf16 weights read back as fp32);
3. after 3 training steps, `--save-hf DIR` writes weights and a `config.json` that
   `from_pretrained(DIR)` loads as is, and the loss of the loaded model on the same tokens equals
   schedrun's loss at step 4 of the same run (taken with the weights after 3 steps) and
   schedrun's loss from `--init DIR`, within 1e-5 (the logits agree through the loss: schedrun
   prints no logits). A bf16 run's `--save-hf` writes bf16 weights and `"torch_dtype":
   "bfloat16"`.

The data file is seq_len + 2 bytes of text (`.txt`: read as bytes; a `.bin` would be read as
uint16 tokens), so that every sequence of every step is the same window (`runtime.md`, "Data and
batches": sequence g starts at (g * seq_len) mod (len - seq_len - 1) = 0): inputs
bytes[0:seq_len], targets bytes[1:seq_len + 1].
"""

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile

import safetensors
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
    # The other tying of each family, and other epsilons and rotary base.
    gpt2_untied = transformers.GPT2Config(
        vocab_size=256, n_positions=SEQ, n_embd=64, n_layer=1, n_head=2, n_inner=128,
        activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        layer_norm_epsilon=1e-6, tie_word_embeddings=False)
    llama_tied = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
        num_attention_heads=8, num_key_value_heads=1, max_position_embeddings=SEQ,
        rms_norm_eps=1e-5, tie_word_embeddings=True, attention_dropout=0.0)
    return [("gpt2", gpt2, transformers.GPT2LMHeadModel),
            ("llama", llama, transformers.LlamaForCausalLM),
            ("gpt2-untied", gpt2_untied, transformers.GPT2LMHeadModel),
            ("llama-tied", llama_tied, transformers.LlamaForCausalLM)]


def randomised(model):
    """`model` with every parameter random, far from its initialisation: matrices normal(0,
    0.15), so that attention is sharp and the loss far from uniform's, and norm gains 1 ± 0.3
    and biases ± 0.3, so that a gain or bias read into the wrong place shows in the loss (with
    `transformers`' ones and zeros it would not)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.3)
            else:
                p.normal_(0.0, 0.15)
    return model


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


def import_model(bin_dir, root, tmp, name, ckpt, dtype=None):
    """The schedule running `schedc import hf` of `ckpt`'s config (its dtype replaced by
    `dtype`), and the parameter count `schedc check` prints."""
    config = os.path.join(ckpt, "config.json")
    if dtype:
        with open(config) as f:
            c = json.load(f)
        c.pop("torch_dtype", None)
        c["dtype"] = dtype
        config = os.path.join(tmp, f"{name}-config.json")
        with open(config, "w") as f:
            json.dump(c, f)
    block = os.path.join(tmp, f"{name}.sched")
    run([os.path.join(bin_dir, "schedc"), "import", "hf", config, "--name", "m", "-o", block])
    sched = os.path.join(tmp, f"{name}_run.sched")
    with open(sched, "w") as f:
        f.write(f'import "{block}"\nimport "{root}/schedules/clusters/cpu.sched"\n'
                "schedule s { model = m  cluster = cpu4  nodes = 1  preset = zero3 }\n")
    check = run([os.path.join(bin_dir, "schedc"), "check", sched])
    count = int(re.search(r"with ([\d,]+) parameters", check).group(1).replace(",", ""))
    return sched, count


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/debug")
    args = ap.parse_args()
    root = os.getcwd()
    tmp = tempfile.mkdtemp(prefix="sched-hf-parity-")
    torch.manual_seed(0)
    # Seeded, like the weights, so that every run prints the same numbers.
    window = list(random.Random(0).randbytes(SEQ + 2))
    data = os.path.join(tmp, "window.txt")
    with open(data, "wb") as f:
        f.write(bytes(window))
    for name, config, cls in configs():
        print(name)
        model = randomised(cls(config).eval())
        ckpt = os.path.join(tmp, name)
        model.save_pretrained(ckpt)
        # 1. The imported model's parameter count.
        sched, count = import_model(args.bin, root, tmp, name, ckpt)
        print(f"  parameters: schedc {count}  transformers {model.num_parameters()}")
        if count != model.num_parameters():
            sys.exit(f"FAIL {name}: parameter counts differ")
        # 2. The first step's loss (fp32 one file, fp32 sharded, bf16).
        want = loss_of(model, window)
        got = schedrun_losses(args.bin, sched, data, ckpt, ["--steps", "1"])[0]
        close(got, want, "first-step loss (fp32)")
        sharded = os.path.join(tmp, f"{name}-sharded")
        model.save_pretrained(sharded, max_shard_size="100KB")
        shards = [f for f in os.listdir(sharded) if f.endswith(".safetensors")]
        assert len(shards) > 1 and "model.safetensors.index.json" in os.listdir(sharded), shards
        got = schedrun_losses(args.bin, sched, data, sharded, ["--steps", "1"])[0]
        close(got, want, f"first-step loss (fp32, {len(shards)} shards)")
        half = os.path.join(tmp, f"{name}-bf16")
        model.to(torch.bfloat16).save_pretrained(half)
        model.float()
        # Read back as saved (bf16, or fp32 by transformers 4's default) and widened exactly:
        # no `dtype`/`torch_dtype` argument, whose name differs between versions 4 and 5.
        rounded = cls.from_pretrained(half).float().eval()
        got = schedrun_losses(args.bin, sched, data, half, ["--steps", "1"])[0]
        close(got, loss_of(rounded, window), "first-step loss (bf16 checkpoint)")
        # 3. Trained weights back into transformers, config.json included.
        saved = os.path.join(tmp, f"{name}-trained")
        losses = schedrun_losses(args.bin, sched, data, ckpt, ["--steps", "4"])
        schedrun_losses(args.bin, sched, data, ckpt, ["--steps", "3", "--save-hf", saved])
        with open(os.path.join(saved, "config.json")) as f:
            written = json.load(f)
        if written.get("model_type") != config.model_type:
            sys.exit(f"FAIL {name}: --save-hf wrote config {written}")
        trained = cls.from_pretrained(saved).eval()
        if trained.num_parameters() != count:
            sys.exit(f"FAIL {name}: the saved model has {trained.num_parameters()} parameters")
        after = loss_of(trained, window)
        close(losses[3], after, "loss after 3 steps (step 4 of schedrun's run) vs --save-hf")
        got = schedrun_losses(args.bin, sched, data, saved, ["--steps", "1"])[0]
        close(got, after, "loss after 3 steps, schedrun --init from --save-hf")
        # A bf16 run writes bf16 weights, and says so in config.json.
        sched16, _ = import_model(args.bin, root, tmp, f"{name}16", ckpt, dtype="bfloat16")
        saved16 = os.path.join(tmp, f"{name}-trained-bf16")
        schedrun_losses(args.bin, sched16, data, ckpt, ["--steps", "1", "--save-hf", saved16])
        with safetensors.safe_open(os.path.join(saved16, "model.safetensors"), "pt") as f:
            dtypes = {f.get_tensor(k).dtype for k in f.keys()}
        with open(os.path.join(saved16, "config.json")) as f:
            said = json.load(f).get("torch_dtype")
        if dtypes != {torch.bfloat16} or said != "bfloat16":
            sys.exit(f"FAIL {name}: a bf16 run's --save-hf wrote {dtypes}, config {said}")
        cls.from_pretrained(saved16)
        print(f"  bf16 run: --save-hf wrote {dtypes.pop()}, config.json says {said}")
    shutil.rmtree(tmp)
    print("ok")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Independent reference for the exact parameter count of every model under schedules/models/.

The counts come straight from the layer table of spec/dsl.md ("model NAME { ... }"), with each model's
hyperparameters hard-coded below. Nothing here reads a .sched file, so that the compiler's count
(`schedc check`, `--emit stats` "parameters") can be tested against a second, separate derivation.

    python3 tests/data/expected_params.py            # rewrite tests/data/expected_params.tsv
    python3 tests/data/expected_params.py --check    # exit 1 if the TSV is out of date
    python3 tests/data/expected_params.py --stdout   # print the table

Keep the hyperparameters here in step with schedules/models/*.sched by hand; a test that compares the two
is what catches a drift in either.
"""

import sys
from pathlib import Path


# ---- layer kinds, formulas copied from dsl.md's table -------------------------------------------------

def embedding(vocab, hidden, positions="learned", *, seq_len):
    # vocab*hidden, plus seq_len*hidden when `learned`
    assert positions in ("learned", "rope", "none")
    n = vocab * hidden
    if positions == "learned":
        n += seq_len * hidden
    return n


def _mlp_weights_and_bias(hidden, ffn, act, bias):
    assert act in ("gelu", "swiglu")
    n = (2 if act == "gelu" else 3) * hidden * ffn
    if bias:
        n += (ffn + hidden) if act == "gelu" else (2 * ffn + hidden)
    return n


def _norm(hidden, norm):
    # layernorm: gain and bias (2*hidden); rmsnorm: gain only (hidden)
    assert norm in ("layernorm", "rmsnorm")
    return 2 * hidden if norm == "layernorm" else hidden


def transformer(hidden, heads, ffn, kv_heads=None, norm="layernorm", act="gelu", bias=True,
                attention="flash"):
    assert attention in ("flash", "naive")          # changes activation memory, not parameters
    if kv_heads is None:
        kv_heads = heads
    assert (hidden * kv_heads) % heads == 0
    kv_dim = hidden * kv_heads // heads
    # attention: qkv projection hidden x (hidden + 2 kv_dim), output projection hidden x hidden
    n = hidden * (hidden + 2 * kv_dim) + hidden * hidden
    if bias:
        n += (hidden + 2 * kv_dim) + hidden
    n += _mlp_weights_and_bias(hidden, ffn, act, bias)
    n += 2 * _norm(hidden, norm)                      # two norms: before attention, before the MLP
    return n


def lm_head(hidden, vocab, norm="layernorm", tied=False):
    # final norm, plus vocab*hidden unless tied to the embedding
    return _norm(hidden, norm) + (0 if tied else vocab * hidden)


# ---- the models of schedules/models/*.sched ------------------------------------------------------------

def gpt(vocab, hidden, heads, ffn, layers, seq_len):
    """GPT-2 family: learned positions, layernorm, gelu, biases, tied head."""
    return (embedding(vocab, hidden, "learned", seq_len=seq_len)
            + layers * transformer(hidden, heads, ffn)
            + lm_head(hidden, vocab, tied=True))


def llama(vocab, hidden, heads, ffn, layers, kv_heads=None, tied=False):
    """LLaMA family: rope, rmsnorm, swiglu, no biases, untied head with an rmsnorm."""
    return (embedding(vocab, hidden, "rope", seq_len=None)
            + layers * transformer(hidden, heads, ffn, kv_heads=kv_heads, norm="rmsnorm",
                                   act="swiglu", bias=False)
            + lm_head(hidden, vocab, norm="rmsnorm", tied=tied))


MODELS = {
    # models/gpt2.sched
    "gpt2":        gpt(vocab=50257, hidden=768,  heads=12, ffn=3072, layers=12, seq_len=1024),
    "gpt2_medium": gpt(vocab=50257, hidden=1024, heads=16, ffn=4096, layers=24, seq_len=1024),
    # models/llama.sched
    "llama_7b":  llama(vocab=32000, hidden=4096, heads=32, ffn=11008, layers=32),
    "llama_13b": llama(vocab=32000, hidden=5120, heads=40, ffn=13824, layers=40),
    "llama_30b": llama(vocab=32000, hidden=6656, heads=52, ffn=17920, layers=60),
    "llama_70b": llama(vocab=32000, hidden=8192, heads=64, ffn=28672, layers=80, kv_heads=8),
    # models/tiny.sched
    "tiny_gpt":  gpt(vocab=256, hidden=64, heads=4, ffn=256, layers=2, seq_len=64),
    "tiny_llama": llama(vocab=256, hidden=64, heads=4, ffn=172, layers=2, kv_heads=2),
}

# Published sizes the formulas must reproduce. The first two are stated in dsl.md itself; the others are the
# counts of the corresponding Hugging Face checkpoints (gpt2-medium, Llama-2-13b, LLaMA-30B/"33B",
# Llama-2-70b), which have exactly these shapes.
PUBLISHED = {
    "gpt2": 124_439_808,
    "llama_7b": 6_738_415_616,
    "gpt2_medium": 354_823_168,
    "llama_13b": 13_015_864_320,
    "llama_30b": 32_528_943_616,
    "llama_70b": 68_976_648_192,
}


def table():
    for name, want in PUBLISHED.items():
        got = MODELS[name]
        if got != want:
            raise SystemExit(f"{name}: formula gives {got:,}, published size is {want:,}")
    lines = ["model\tparameters"] + [f"{name}\t{count}" for name, count in MODELS.items()]
    return "\n".join(lines) + "\n"


def main(argv):
    text = table()
    out = Path(__file__).with_name("expected_params.tsv")
    if "--stdout" in argv:
        sys.stdout.write(text)
    elif "--check" in argv:
        if not out.exists() or out.read_text() != text:
            print(f"{out} is out of date: run {Path(__file__).name}", file=sys.stderr)
            return 1
    else:
        out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

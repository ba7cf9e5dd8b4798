"""A random-weight tenant model of a named shape, with the tokenizer of a model already built (the vLLM recipe's test
model): the harvest benchmark's tenant where the GPU, not vLLM's engine core, should set the pace.

With the recipe's 1.36 B model vLLM's engine core is one Python loop flat out at ~500 running (GPU 25-60 % busy), so
its rate is the host CPU's, and on a shared host that moved by up to 2x within minutes (an H200, 2026-12-03): a row
and the capacity pass it is read over measured the host in between. A model of Qwen2-7B's shape does about five
times the GPU work per step for the same scheduling work, so the GPU sets the step.

    python3 benchmarks/tenant_model.py /root/model-7b --shape qwen2-7b --tokenizer /root/model [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

SHAPES: dict[str, dict[str, int]] = {
    # Qwen2-7B's published shape (hidden, MLP width, layers, heads, KV heads): 6.76 B parameters with a 32 000 vocab
    "qwen2-7b": {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                 "num_attention_heads": 28, "num_key_value_heads": 4},
    # Qwen2.5-14B's published shape: 13.54 B parameters with a 32 000 vocab (27 GB in bf16: start vLLM with
    # --gpu-memory-utilization 0.6 or more for 512 in flight of 512-token answers). Where even the 7 B's step is
    # set by the engine core's CPU (48-token answers, 400-540 requests a second, H200, 2026-12-03)
    "qwen2.5-14b": {"hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 48,
                    "num_attention_heads": 40, "num_key_value_heads": 8},
    # the recipe's test model, for comparison runs on one payload
    "qwen2-1.5b": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                   "num_attention_heads": 12, "num_key_value_heads": 2},
    # a few MB: this file's own test, on a CPU
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2},
}


def parameters(shape: dict[str, int], vocab: int) -> int:
    """Parameters of a Qwen2 decoder of ``shape`` with untied embeddings, known beforehand (Qwen2-7B's vocabulary of
    152 064 gives its published 7 615 616 512); the build prints both."""
    h, f, kv = shape["hidden_size"], shape["intermediate_size"], shape["num_key_value_heads"]
    head = h // shape["num_attention_heads"]
    attn = h * h + h + 2 * (h * kv * head + kv * head) + h * h  # q (with bias), k and v (with bias), o
    layer = attn + 3 * h * f + 2 * h  # gate, up, down; two norms
    return 2 * vocab * h + shape["num_hidden_layers"] * layer + h  # embeddings, head, the layers, the final norm


def build(out: Path, shape_name: str, tokenizer: Path, device: str) -> dict[str, object]:
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer)
    shape = SHAPES[shape_name]
    cfg = Qwen2Config(vocab_size=len(tok), max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                      tie_word_embeddings=False, hidden_act="silu", bos_token_id=tok.eos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id, torch_dtype="bfloat16",
                      use_sliding_window=False, **shape)
    t0 = time.monotonic()
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return {"out": str(out), "shape": shape_name, "params": sum(p.numel() for p in model.parameters()),
            "expected_params": parameters(shape, len(tok)), "vocab": len(tok),
            "bytes_on_disk": sum(f.stat().st_size for f in out.iterdir()), "build_s": round(time.monotonic() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2-7b")
    ap.add_argument("--tokenizer", type=Path, required=True, help="a model folder whose tokenizer the tenant uses")
    ap.add_argument("--device", default="cuda", help="where the weights are drawn (cuda: seconds for 7 B)")
    args = ap.parse_args(argv)
    if not (args.tokenizer / "tokenizer_config.json").is_file():
        ap.error(f"--tokenizer {args.tokenizer}: no tokenizer_config.json there (build the recipe's model first)")
    if args.out.exists() and any(args.out.iterdir()):
        ap.error(f"{args.out}: not empty; name a new folder")
    print(json.dumps(build(args.out, args.shape, args.tokenizer, args.device)), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())

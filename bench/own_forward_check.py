"""What the check against the model's own forward costs, once per model, next to a generation.

    python bench/own_forward_check.py [--layers 4 8] [--hidden 512] [--max-new-tokens 64]

For each target (the embedded tiny pair's, then random Qwen3 targets of the given depths and width, fp32, one
thread), one process: the first ``TargetAdapter`` open (which runs the check:
:mod:`dflash.target.own_forward_check`), a second open (the verdict is kept: no check), and a
``dflash.generate(method="ar")`` of ``--max-new-tokens`` tokens on a 128-token prompt after both. Prints a
markdown table: the check's seconds (first open minus second), the generation's, and their ratio.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


def _time(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def measure(target, max_new_tokens: int) -> dict:
    import dflash
    from dflash.target import TargetAdapter

    prompt = torch.randint(0, target.config.vocab_size, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.inference_mode():
        first = _time(lambda: TargetAdapter(target).close())
        again = _time(lambda: TargetAdapter(target).close())
        gen = _time(lambda: dflash.generate(target, None, prompt, method="ar", max_new_tokens=max_new_tokens))
    return dict(check=max(first - again, 0.0), open=again, generate=gen)


def _random_qwen3(layers: int, hidden: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=32000, hidden_size=hidden, intermediate_size=3 * hidden,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=2,
                         head_dim=64, max_position_embeddings=4096, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    return model


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, nargs="*", default=[4, 8])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--max-new-tokens", type=int, default=64)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from dflash.tiny.pair import load_default_pair

    targets = [("tiny pair target", load_default_pair()[0])]
    targets += [(f"Qwen3 {n} layers x {args.hidden}", _random_qwen3(n, args.hidden)) for n in args.layers]
    print(f"| target | check (s) | adapter open after it (s) | ar generate, {args.max_new_tokens} tokens (s) "
          "| check / generate |")
    print("|---|---|---|---|---|")
    for name, target in targets:
        r = measure(target, args.max_new_tokens)
        print(f"| {name} | {r['check']:.4f} | {r['open']:.4f} | {r['generate']:.3f} | "
              f"{r['check'] / r['generate']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Build a tiny random-weight Llama and a small BPE tokenizer in a folder, for running a
real vLLM on a CPU in tests without downloading any weights.

    python scripts/make_tiny_model.py OUT_DIR [--seed 0] [--vocab 1024] [--no-weights]

Runs in the vLLM venv (scripts/vllm_cpu_env.sh): it needs torch, transformers and
tokenizers (with --no-weights, no torch: the tokenizer and configs for Dynamo's mocker,
which simulates the model, built in Dynamo's venv, scripts/dynamo_cpu_env.sh). The tokenizer is a byte-level BPE trained with ``tokenizers`` on a text built
into this script, so any input text encodes (no unknown tokens); it carries a chat template,
so the server's ``/v1/chat/completions`` works. The model is a 2-layer Llama with hidden
size 128 and head dim 64 (vLLM's CPU attention rejects smaller heads), seeded, so the same
seed gives the same weights. Its output is noise; the point is real prefill, real KV
blocks, real scheduling. A stamp file makes a second run with the same settings a no-op.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}</s>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

SPECIAL = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>",
           "<|tool|>"]

_WORDS = (
    "the agent reads a file then runs the tests and edits the code until the build passes "
    "a program waits for its tool call while another program reasons on the accelerator "
    "memory holds the key value cache of every token the model has seen in its context "
    "when the pool is full the engine evicts the least recently used blocks first "
    "def main(argv): return run(parse(argv)) import os sys json path open read write "
    "class Program: idle busy inactive promote demote release gate forward prefetch "
    "error: file not found; traceback (most recent call last): line 42 in module "
    "0 1 2 3 4 5 6 7 8 9 10 100 1000 { } [ ] ( ) < > = + - * / , . ; : ' \" _ # @ "
)


def corpus() -> list[str]:
    """A deterministic training text: the word list in many orders."""
    words = _WORDS.split()
    lines = []
    for step in range(1, 60):
        lines.append(" ".join(words[(i * step) % len(words)] for i in range(len(words))))
    return lines


def build_tokenizer(out: Path, vocab: int) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        pad_token="<pad>", additional_special_tokens=SPECIAL[4:])
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 1 << 20
    fast.save_pretrained(str(out))
    return int(tok.get_vocab_size())


def llama_config(vocab: int, max_len: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64,
        max_position_embeddings=max_len, bos_token_id=1, eos_token_id=2, pad_token_id=3,
        tie_word_embeddings=False, torch_dtype="bfloat16")


def build_config(out: Path, vocab: int, max_len: int) -> None:
    """The model's config and generation config without weights (no torch): enough for
    an engine that only simulates the model (Dynamo's mocker) and a frontend that
    tokenizes for it."""
    from transformers import GenerationConfig

    cfg = llama_config(vocab, max_len)
    cfg.architectures = ["LlamaForCausalLM"]  # a model card needs it (save_pretrained of the
    cfg.save_pretrained(str(out))             # model adds it; of the config alone, not)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=3).save_pretrained(str(out))


def build_model(out: Path, vocab: int, seed: int, max_len: int) -> None:
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = llama_config(vocab, max_len)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=3).save_pretrained(str(out))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--max-len", type=int, default=8192)
    ap.add_argument("--no-weights", action="store_true",
                    help="the tokenizer and configs only, without torch (for Dynamo's mocker)")
    args = ap.parse_args(argv)
    settings: dict[str, Any] = {"seed": args.seed, "vocab": args.vocab,
                                "max_len": args.max_len, "v": 1}
    if args.no_weights:
        settings["weights"] = False
        settings["config"] = 2
    stamp = args.out / ".mori-tiny-model.json"
    if stamp.exists() and json.loads(stamp.read_text()) == settings:
        print(args.out)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(args.out, args.vocab)
    if args.no_weights:
        build_config(args.out, vocab, args.max_len)
    else:
        build_model(args.out, vocab, args.seed, args.max_len)
    stamp.write_text(json.dumps(settings))
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

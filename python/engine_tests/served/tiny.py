"""Tiny models for a live server: a config, seeded f32 weights as safetensors, and a byte-level
BPE tokenizer trained here (no hub), so that ``vllm serve DIR`` starts offline."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import oracle  # noqa: E402 - the engine tests' configs

# The engine tests' small models, as a server needs them: heads of 32 (the CPU attention
# kernels take 32, 64, 80, ...: not 16), the tokenizer's special tokens, and the dtype the
# server is started with instead of the config's.
SERVED = {"head_dim": 32, "bos_token_id": 1, "eos_token_id": 2}
CONFIGS = {
    kind: dict(
        {k: v for k, v in config.items() if k not in ("torch_dtype", "transformers_version")}, **SERVED
    )
    for kind, config in (("qwen3", oracle.QWEN3), ("llama", oracle.LLAMA), ("qwen3_moe", oracle.QWEN3_MOE))
}

TEXT = (
    "the quick brown fox jumps over the lazy dog. a refit moves the weights of a model from "
    "the trainer to the server, every step, while it serves. numbers 0 1 2 3 4 5 6 7 8 9. "
)


def tokenizer(directory: Path) -> None:
    """A byte-level BPE tokenizer of a few hundred tokens, trained on a fixed text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([TEXT] * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(directory))


def model(directory: Path, kind: str = "qwen3", seed: int = 0, dtype: str = "float32", **sizes) -> Path:
    """``directory`` holding a tiny ``kind`` model: config.json (``torch_dtype`` ``dtype``;
    ``sizes`` override the config's fields), its weights drawn from ``seed`` (stored in f32)
    and the tokenizer."""
    import transformers

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = transformers.AutoConfig.for_model(**dict(CONFIGS[kind], **sizes))
    torch.manual_seed(seed)
    net = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():
        for p in net.parameters():  # larger than the default init: greedy tokens that vary
            p.normal_(0.0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    net.save_pretrained(str(directory), safe_serialization=True)
    raw = json.loads((directory / "config.json").read_text())
    raw["torch_dtype"] = raw["dtype"] = dtype
    (directory / "config.json").write_text(json.dumps(raw, indent=1))
    tokenizer(directory)
    return directory

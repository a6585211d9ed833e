"""Tiny models for a live server: a config, seeded f32 weights as safetensors, and a byte-level
BPE tokenizer trained here (no hub), so that ``vllm serve DIR`` starts offline."""

from __future__ import annotations

import json
from pathlib import Path

import torch

BASE = {
    "vocab_size": 1000,  # padded by vLLM to a multiple of 64 per rank: uneven rows
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,  # the CPU attention kernels take 32, 64, 80, ...: not 16
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
QWEN3 = dict(BASE, architectures=["Qwen3ForCausalLM"], model_type="qwen3", tie_word_embeddings=False)
LLAMA = dict(BASE, architectures=["LlamaForCausalLM"], model_type="llama", tie_word_embeddings=False)
QWEN3_MOE = dict(
    QWEN3,
    architectures=["Qwen3MoeForCausalLM"],
    model_type="qwen3_moe",
    moe_intermediate_size=32,
    num_experts=4,
    num_experts_per_tok=2,
    decoder_sparse_step=1,
    mlp_only_layers=[],
)
CONFIGS = {"qwen3": QWEN3, "llama": LLAMA, "qwen3_moe": QWEN3_MOE}

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

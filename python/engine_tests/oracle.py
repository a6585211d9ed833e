"""What every engine's test shares: the small models' configs, a seeded checkpoint, the
checkpoint as it lies on disk, and the check itself: the engine's own ``load_weights`` of the
full checkpoint is the oracle, and a refit into scrambled parameters must equal it byte for
byte, padding rows included, in the same storage."""

import json
import os
import re
from pathlib import Path

import torch

from reshard import Refit
from reshard.torch import local_tensor

BASE = {
    "vocab_size": 1000,  # padded by the engines to 1024: uneven rows on every rank
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "torch_dtype": "bfloat16",
    "rms_norm_eps": 1e-6,
}
QWEN3 = dict(BASE, architectures=["Qwen3ForCausalLM"], model_type="qwen3", tie_word_embeddings=False)
QWEN3_TIED = dict(QWEN3, tie_word_embeddings=True)
LLAMA = dict(BASE, architectures=["LlamaForCausalLM"], model_type="llama", tie_word_embeddings=False)
QWEN3_MOE = dict(
    QWEN3,
    architectures=["Qwen3MoeForCausalLM"],
    model_type="qwen3_moe",
    moe_intermediate_size=32,
    num_experts=4,
    num_experts_per_tok=2,
    transformers_version="5.20.2",
)


GEMMA2 = dict(
    architectures=["Gemma2ForCausalLM"],
    model_type="gemma2",
    tie_word_embeddings=True,
    query_pre_attn_scalar=16,
    sliding_window=64,
)

# Architectures the package has no rules or family code for, refit from the trainer's own
# tensors (transformers' model of the same config) into vLLM's classes: each config is BASE
# with what the architecture needs.
ARCHITECTURES = {
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", tie_word_embeddings=False),
    "mistral": dict(architectures=["MistralForCausalLM"], model_type="mistral", tie_word_embeddings=False),
    "phi3": dict(
        architectures=["Phi3ForCausalLM"], model_type="phi3", tie_word_embeddings=False, pad_token_id=0
    ),
    "gemma2": GEMMA2,
    "gemma3": dict(GEMMA2, architectures=["Gemma3ForCausalLM"], model_type="gemma3_text"),
    "qwen2_moe": dict(
        architectures=["Qwen2MoeForCausalLM"],
        model_type="qwen2_moe",
        tie_word_embeddings=False,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
    ),
    "deepseek_v2": dict(
        architectures=["DeepseekV2ForCausalLM"],
        model_type="deepseek_v2",
        tie_word_embeddings=False,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        first_k_dense_replace=1,
        kv_lora_rank=32,
        q_lora_rank=None,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
    ),
    "olmo2": dict(architectures=["Olmo2ForCausalLM"], model_type="olmo2", tie_word_embeddings=False),
    "granite": dict(architectures=["GraniteForCausalLM"], model_type="granite", tie_word_embeddings=False),
    "gpt_neox": dict(architectures=["GPTNeoXForCausalLM"], model_type="gpt_neox", tie_word_embeddings=False),
    "cohere": dict(architectures=["CohereForCausalLM"], model_type="cohere", tie_word_embeddings=True),
    "stablelm": dict(architectures=["StableLmForCausalLM"], model_type="stablelm", tie_word_embeddings=False),
    "glm": dict(
        architectures=["GlmForCausalLM"], model_type="glm", tie_word_embeddings=False, pad_token_id=0
    ),
    "llama_biases": dict(LLAMA, attention_bias=True, mlp_bias=True),
}
MOE_ARCHITECTURES = ("qwen2_moe", "deepseek_v2")


def architecture(name: str) -> dict:
    """The config of ``ARCHITECTURES[name]``."""
    extra = ARCHITECTURES[name]
    return dict(extra) if "hidden_size" in extra else dict(BASE, **extra)


def write_config(directory: Path, config: dict) -> str:
    """``directory/config.json``, written whole at once: every rank writes it while the others
    may be reading it, so each writes a file of its own and renames it into place."""
    directory.mkdir(parents=True, exist_ok=True)
    mine = directory / f"config.json.{os.getpid()}"
    mine.write_text(json.dumps(config))
    os.replace(mine, directory / "config.json")
    return str(directory)


def case(name, config, train, **kw):
    return dict(kw, name=name, config=config, train=train)


def checkpoint(refit: Refit, seed: int):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(refit.layouts(n)[0].shape, generator=g) * 0.02 for n in refit.names}


def shards(refit: Refit, rank: int, full):
    """This rank's training shards of the whole tensors ``full``."""
    src = {n: local_tensor(refit.layouts(n)[0], rank, full[n]) for n in refit.names}
    return {n: t for n, t in src.items() if t is not None}


_STACKED = re.compile(r"^(.*\.experts)\.(gate_proj|up_proj|down_proj)(?:\.weight)?$")


def on_disk(full):
    """A checkpoint as Hugging Face's safetensors hold it: routed experts one tensor each."""
    for name, tensor in full.items():
        stacked = _STACKED.match(name) if tensor.dim() == 3 else None
        if stacked is None:
            yield name, tensor
            continue
        for e in range(tensor.shape[0]):
            yield f"{stacked.group(1)}.{e}.{stacked.group(2)}.weight", tensor[e]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8)


def scramble(params) -> None:
    """Noise in every parameter, in place, so that a refit that misses an element shows."""
    with torch.no_grad():
        for p in params.values():
            p.data.copy_(torch.randn(p.shape).to(p.dtype))


def against_the_loader(name: str, model, rank: int, inputs, refit_step, steps: int = 2) -> int:
    """For each step: ``inputs(step)`` gives the whole tensors and this rank's sources; the
    model's own ``load_weights`` of the whole tensors is the oracle; the parameters are then
    scrambled, ``refit_step(src)`` runs, and they must equal the oracle byte for byte in the
    same storage. Returns the parameters checked."""
    params = dict(model.named_parameters())
    ptrs = {n: p.data_ptr() for n, p in params.items()}
    for step in range(steps):
        full, src = inputs(step)
        with torch.no_grad():
            model.load_weights(on_disk(full))
        oracle = {n: p.detach().clone() for n, p in params.items()}
        scramble(params)
        refit_step(src)
        for n, p in params.items():
            assert p.data_ptr() == ptrs[n], f"{n}: storage changed"
            if not torch.equal(bits(p), bits(oracle[n])):
                diff = (p.float() - oracle[n].float()).abs()
                where = diff.nonzero()[:4].tolist()
                raise AssertionError(f"{name} step {step}: {n} differs on rank {rank} at {where}")
    return len(params)


def check_the_table(refit: Refit, model, rank: int, engine: str, ep: bool = False) -> None:
    """The table of engine parameters (``engine_params``: names, shapes, dtypes) is the
    engine's own ``named_parameters()``, buffer for buffer (under expert parallelism the
    experts are split otherwise than the table's tensor parallelism: those are left out)."""
    from reshard.engine import engine_params

    table = engine_params(refit, rank, engine)
    real = {n: (tuple(p.shape), p.dtype) for n, p in model.named_parameters()}
    if ep:
        table = {n: v for n, v in table.items() if ".experts." not in n}
        real = {n: v for n, v in real.items() if ".experts." not in n}
    if table != real:
        names = sorted(set(table) | set(real))
        lines = [
            f"{n}: table {table.get(n)}, {engine} {real.get(n)}" for n in names if table.get(n) != real.get(n)
        ]
        raise AssertionError(f"engine_params differs from {engine}'s parameters:\n" + "\n".join(lines))

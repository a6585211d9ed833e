"""Where an engine's loader puts each checkpoint slice, recorded from the loader itself: an
engine module written like vLLM's (q, k and v fused, the vocabulary padded to 64 rows and the
padding zeroed, kv heads replicated past their count) refit from trainer shards equals its own
loader run on the full tensors; loaders a refit cannot follow are refused on every rank.
(python/engine_tests checks vLLM's own model classes the same way.)"""

import json

import pytest
import torch

from conftest import run_ranks
from reshard import AgreementError, ArgumentError, Layout, Refit, Replicate, Shard
from reshard.engine.recorded import split_layout
from reshard.engine import refit_engine_
from reshard.torch import local_tensor

CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 1000,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 8,
    "tie_word_embeddings": False,
    "dtype": "float32",
}
P = "model.layers.0.self_attn."


class Engine(torch.nn.Module):
    """One tensor-parallel rank of an engine that loads like vLLM, for these four tensors."""

    def __init__(self, tp: int, rank: int, how: str, c: dict):
        super().__init__()
        self.kv_heads = c["num_key_value_heads"]
        self.tp, self.rank, self.how = tp, rank, how
        self.per = -(-c["vocab_size"] // 64) * 64 // tp
        hd, hidden = c["head_dim"], c["hidden_size"]
        self.q = c["num_attention_heads"] * hd // tp
        self.kv = max(1, c["num_key_value_heads"] // tp) * hd
        self.embed = torch.nn.Parameter(torch.randn(self.per, hidden), requires_grad=False)
        self.qkv = torch.nn.Parameter(torch.randn(self.q + 2 * self.kv, hidden), requires_grad=False)
        self.norm = torch.nn.Parameter(torch.randn(hidden), requires_grad=False)

    def load_weights(self, weights):
        kv_heads = self.kv_heads
        for name, w in weights:
            if name == "model.embed_tokens.weight":
                rows = w[self.rank * self.per : (self.rank + 1) * self.per]
                self.embed.data[: len(rows)].copy_(rows)
                self.embed.data[len(rows) :].zero_()
            elif name == "model.norm.weight":
                self.norm.data.copy_(w)
            elif name == P + "q_proj.weight":
                self.qkv.data[: self.q].copy_(w[self.rank * self.q : (self.rank + 1) * self.q])
            elif name in (P + "k_proj.weight", P + "v_proj.weight"):
                head = self.rank * kv_heads // self.tp  # the kv head this rank's q heads use
                at = self.q + (0 if name.startswith(P + "k") else self.kv)
                piece = w[head * self.kv : (head + 1) * self.kv]
                if self.how == "transpose":  # square here: a column holds a row
                    piece = piece.t()
                elif self.how == "shuffle":
                    order = torch.randperm(piece.numel(), generator=torch.Generator().manual_seed(0))
                    piece = piece.reshape(-1)[order].view(piece.shape)
                self.qkv.data[at : at + self.kv].copy_(piece)
            elif name == P + "o_proj.weight" and self.how == "skip_norm":
                pass


def _full(refit, seed):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(refit.layouts(n)[0].shape, generator=g) for n in refit.names}


def _refit(rank, world, path, train, how):
    refit = Refit(path, train, f"tp={world}", colocated=True)
    engine = Engine(world, rank, how, json.loads(open(path).read()))
    ptrs = {n: p.data_ptr() for n, p in engine.named_parameters()}
    for seed in range(2):
        full = _full(refit, seed)
        engine.load_weights(full.items())
        want = {n: p.detach().clone() for n, p in engine.named_parameters()}
        for p in engine.parameters():
            p.data.normal_()
        src = {n: local_tensor(refit.layouts(n)[0], rank, full[n]) for n in refit.names}
        refit_engine_(refit, {n: t for n, t in src.items() if t is not None}, engine)
        for n, p in engine.named_parameters():
            assert p.data_ptr() == ptrs[n]
            assert torch.equal(p, want[n]), (n, rank)


@pytest.mark.parametrize("train, how", [("fsdp=2", "vllm"), ("tp=2", "vllm"), ("fsdp=2", "transpose")])
def test_refit_equals_the_engines_own_loader(tmp_path, train, how):
    # a loader that transposes k and v is followed too: a column of the parameter holds a
    # row of the checkpoint tensor, one piece per column
    path = tmp_path / "config.json"
    config = CONFIG if how == "vllm" else dict(CONFIG, head_dim=32, num_attention_heads=2)
    path.write_text(json.dumps(config))
    run_ranks(_refit, 2, str(path), train, how, timeout=60)


def _refused(rank, world, path, how):
    refit = Refit(path, "fsdp=2", f"tp={world}", colocated=True)
    engine = Engine(world, rank, how if rank == 1 else "vllm", json.loads(open(path).read()))
    if how == "unfilled" and rank == 1:
        engine.extra = torch.nn.Parameter(torch.zeros(3), requires_grad=False)
    full = _full(refit, 0)
    src = {n: local_tensor(refit.layouts(n)[0], rank, full[n]) for n in refit.names}
    src = {n: t for n, t in src.items() if t is not None}
    want = {
        "shuffle": (ArgumentError, r"qkv: the engine's loader puts .*k_proj.* in more than"),
        "unfilled": (ArgumentError, r"unfilled: extra \(3 of 3 elements\): the trainer holds no extra"),
    }[how]
    error, text = want if rank == 1 else (AgreementError, r"rank 1 could not record")
    with pytest.raises(error, match=text):
        refit_engine_(refit, src, engine)


@pytest.mark.parametrize("how", ["shuffle", "unfilled"])
def test_a_loader_a_refit_cannot_follow_is_refused_on_every_rank(tmp_path, how):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(CONFIG, head_dim=32, num_attention_heads=2)))
    run_ranks(_refused, 2, str(path), how, timeout=60)


def test_split_layouts_from_boxes():
    # tensor-parallel rows over ranks 4, 5
    got = split_layout((8, 3), "f32", {4: ((0, 0), (4, 3)), 5: ((4, 0), (4, 3))})
    assert got == Layout((8, 3), "f32", 2, [4, 5], [Shard(0)])
    # one kv head on two ranks of four: cut in two, each part on two ranks
    boxes = {r: ((r // 2 * 4, 0), (4, 3)) for r in range(4)}
    got = split_layout((8, 3), "f32", boxes)
    assert got == Layout((8, 3), "f32", [2, 2], [0, 1, 2, 3], [Shard(0), Replicate()])
    # replicated everywhere; and torch.chunk's uneven split (3 + 2)
    assert split_layout((5,), "f32", {0: ((0,), (5,)), 1: ((0,), (5,))}).placements == (Replicate(),)
    assert split_layout((5,), "f32", {0: ((0,), (3,)), 1: ((3,), (2,))}) is not None
    # the engines' padded vocabulary (4 + 1 of 5 rows), a hole, an odd replica count: none
    assert split_layout((5,), "f32", {0: ((0,), (4,)), 1: ((4,), (1,))}) is None
    assert split_layout((6,), "f32", {0: ((0,), (3,))}) is None
    assert split_layout((4,), "f32", {0: ((0,), (2,)), 1: ((2,), (2,)), 2: ((2,), (2,))}) is None

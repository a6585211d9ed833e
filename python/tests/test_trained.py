"""A refit into an engine whose training side is read from the trainer's own tensors: no
``Refit``, no config, no model family (``refit_engine_(None, src, engine)``). DTensors give
their layouts, whole tensors are replicas; the engine's parameters end as its own loader
leaves them from the full tensors; what the trainer lacks is named as the trainer's, what
the loader leaves empty as the engine's, on every rank."""

import pytest
import torch
import torch.distributed as dist

from conftest import run_ranks
from reshard import AgreementError, ArgumentError
from reshard.engine import refit_engine_
from reshard.engine.trained import trained

HIDDEN, VOCAB, LAYERS, HEAD = 16, 100, 2, 4
Q, KV = 4 * HEAD, 2 * HEAD  # 4 query heads, 2 kv heads


def checkpoint(seed: int, bias: bool = False):
    """A small model's tensors, named as an HF checkpoint names them (an architecture the
    package has no rules for: an ``mlp.fc1``/``fc2`` pair with biases)."""
    g = torch.Generator().manual_seed(seed)
    out = {"model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=g)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = torch.randn(Q, HIDDEN, generator=g)
        out[p + "self_attn.k_proj.weight"] = torch.randn(KV, HIDDEN, generator=g)
        out[p + "self_attn.v_proj.weight"] = torch.randn(KV, HIDDEN, generator=g)
        out[p + "mlp.fc1.weight"] = torch.randn(3 * HIDDEN, HIDDEN, generator=g)
        out[p + "mlp.fc1.bias"] = torch.randn(3 * HIDDEN, generator=g)
        out[p + "mlp.fc2.weight"] = torch.randn(HIDDEN, 3 * HIDDEN, generator=g)
    out["model.norm.weight"] = torch.randn(HIDDEN, generator=g)
    return out


def _module(root: torch.nn.Module, path: str) -> torch.nn.Module:
    for part in path.split("."):
        if not hasattr(root, part):
            root.add_module(part, torch.nn.Module())
        root = getattr(root, part)
    return root


class Engine(torch.nn.Module):
    """One tensor-parallel rank of an engine loading as vLLM does: q, k, v fused, fc1 split
    by rows, fc2 by columns, the vocabulary padded to 64 rows a rank, bf16 parameters."""

    def __init__(self, tp: int, rank: int, how: str = "ok"):
        super().__init__()
        self.tp, self.rank, self.how = tp, rank, how
        self.per = -(-VOCAB // 64) * 64 // tp
        shapes = {"model.embed_tokens.weight": (self.per, HIDDEN), "model.norm.weight": (HIDDEN,)}
        for i in range(LAYERS):
            p = f"model.layers.{i}."
            shapes[p + "self_attn.qkv_proj.weight"] = ((Q + 2 * KV) // tp, HIDDEN)
            shapes[p + "mlp.fc1.weight"] = (3 * HIDDEN // tp, HIDDEN)
            shapes[p + "mlp.fc1.bias"] = (3 * HIDDEN // tp,)
            shapes[p + "mlp.fc2.weight"] = (HIDDEN, 3 * HIDDEN // tp)
        for name, shape in shapes.items():
            module, leaf = name.rsplit(".", 1)
            param = torch.nn.Parameter(torch.randn(shape).to(torch.bfloat16), requires_grad=False)
            _module(self, module).register_parameter(leaf, param)

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        r, tp = self.rank, self.tp
        for name, w in weights:
            if name == "model.embed_tokens.weight":
                rows = w[r * self.per : (r + 1) * self.per]
                params[name].data[: len(rows)].copy_(rows)
                params[name].data[len(rows) :].zero_()
            elif name == "model.norm.weight":
                if self.how != "drop_norm":
                    params[name].data.copy_(w)
            elif ".self_attn." in name:
                fused = params[name.rsplit(".self_attn.", 1)[0] + ".self_attn.qkv_proj.weight"]
                q, kv = Q // tp, KV // tp
                at = {"q_proj": 0, "k_proj": q, "v_proj": q + kv}[name.split(".")[-2]]
                n = q if "q_proj" in name else kv
                fused.data[at : at + n].copy_(w[r * n : (r + 1) * n])
            elif name.endswith("fc2.weight"):
                n = w.shape[1] // tp
                params[name].data.copy_(w[:, r * n : (r + 1) * n])
            else:
                n = w.shape[0] // tp
                params[name].data.copy_(w[r * n : (r + 1) * n])


def _oracle(engine, full):
    engine.load_weights(full.items())
    return {n: p.detach().clone() for n, p in engine.named_parameters()}


def _check(engine, want, ptrs):
    for n, p in engine.named_parameters():
        assert p.data_ptr() == ptrs[n], f"{n}: storage changed"
        assert torch.equal(p.view(torch.int16), want[n].view(torch.int16)), n


def _fsdp2(rank, world):
    """FSDP2's DTensors (dim 0 over both ranks) into a tp=2 engine on the same ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    engine = Engine(world, rank)
    ptrs = {n: p.data_ptr() for n, p in engine.named_parameters()}
    for seed in range(2):
        full = checkpoint(seed)
        want = _oracle(engine, full)
        for p in engine.parameters():
            p.data.normal_()
        src = {n: distribute_tensor(t, mesh, [Shard(0)]) for n, t in full.items()}
        refit_engine_(None, src, engine)
        _check(engine, want, ptrs)


def test_dtensors_refit_with_no_refit_and_no_config():
    run_ranks(_fsdp2, 2, timeout=60)


def _whole(rank, world):
    """A trainer holding whole tensors on rank 0 (engine None there), the engine on ranks 1
    and 2; then the same with replicas on ranks 0 and 1 and the engine on 1 and 2."""
    engine = Engine(2, rank - 1) if rank > 0 else None
    ptrs = {n: p.data_ptr() for n, p in engine.named_parameters()} if engine else {}
    for seed, trainers in ((0, (0,)), (1, (0, 1))):
        full = checkpoint(seed)
        want = _oracle(engine, full) if engine else None
        if engine:
            for p in engine.parameters():
                p.data.normal_()
        src = {n: t.clone() for n, t in full.items()} if rank in trainers else None
        refit_engine_(None, src, engine)
        if engine:
            _check(engine, want, ptrs)
    side, _ = trained({"x": torch.zeros(3)} if rank != 1 else None, None, rank)
    assert side.layout("x").ranks == (0, 2) and side.shapes == {"x": (3,)}


def test_whole_tensors_are_replicas_on_the_ranks_that_hold_them():
    run_ranks(_whole, 3, timeout=60)


def _refused(rank, world, how):
    full = checkpoint(0)
    engine = Engine(world, rank, "drop_norm" if how == "engine" else "ok")
    src = {n: t.clone() for n, t in full.items()}
    if how == "shape" and rank == 1:
        src["model.norm.weight"] = torch.zeros(HIDDEN + 1)
    if how == "shards":  # FSDP's shards as plain tensors: not replicas, refused
        src = {n: t.chunk(world)[rank].clone() if n.endswith("q_proj.weight") else t for n, t in src.items()}
    if how == "meta" and rank == 1:
        src["model.norm.weight"] = torch.empty(HIDDEN, device="meta")
    if how == "lacks":
        del src["model.layers.1.self_attn.k_proj.weight"]
    before = {n: p.detach().clone() for n, p in engine.named_parameters()}
    mine = {
        "shape": r"model.norm.weight: rank 0 holds a tensor \[16\] float32, rank 1 a tensor \[17\]",
        "meta": r"src: model.norm.weight is a meta tensor",
        "shards": r"src: model.layers.0.self_attn.q_proj.weight: ranks 0 and 1 hold plain tensors of one",
        "lacks": r"the trainer holds no model.layers.1.self_attn.k_proj.weight, which other layers have",
        "engine": r"the engine's loader fills no value into model.norm.weight .*though the trainer gives",
    }[how]
    if how == "meta":
        want = (ArgumentError, mine) if rank == 1 else (AgreementError, "rank 1: " + mine)
    elif how in ("lacks", "engine"):
        want = (ArgumentError, mine) if rank == 0 else (AgreementError, "rank 0 could not record")
    else:
        want = (ArgumentError, mine)
    with pytest.raises(want[0], match=want[1]):
        refit_engine_(None, src, engine)
    for n, p in engine.named_parameters():
        assert torch.equal(p, before[n]), f"{n} changed by a refused refit"
    dist.barrier()


@pytest.mark.parametrize("how", ["shape", "shards", "meta", "lacks", "engine"])
def test_refusals_name_the_side_on_every_rank(how):
    run_ranks(_refused, 2, how, timeout=60)


def _staged_and_delta(rank, world):
    """A staged refit (prepare, then commit or abort) and a delta refit, both with the
    training side from FSDP2's DTensors: committed versions equal the loader's, an aborted
    one leaves the parameters as they were."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from reshard.engine import abort_engine_, commit_engine_, prepare_engine_
    from reshard.torch import DeltaSession

    mesh = init_device_mesh("cpu", (world,))
    engine = Engine(world, rank)
    ptrs = {n: p.data_ptr() for n, p in engine.named_parameters()}
    session = DeltaSession()
    served = None
    for version, commit in ((1, True), (2, False), (3, True)):
        full = checkpoint(version)
        want = _oracle(engine, full) if commit else served
        if served is not None:
            for n, p in engine.named_parameters():
                p.data.copy_(served[n])
        src = {n: distribute_tensor(t, mesh, [Shard(0)]) for n, t in full.items()}
        prepare_engine_(None, src, engine, session, version)
        (commit_engine_ if commit else abort_engine_)(session, version)
        _check(engine, want, ptrs)
        served = {n: p.detach().clone() for n, p in engine.named_parameters()}
    for seed in (4, 5):
        full = checkpoint(seed)
        if seed == 5:
            full["model.norm.weight"] += 1  # one tensor changed, the rest as before
            full = {n: (t if n == "model.norm.weight" else checkpoint(4)[n]) for n, t in full.items()}
        want = _oracle(engine, full)
        for n, p in engine.named_parameters():
            p.data.copy_(served[n])
        src = {n: distribute_tensor(t, mesh, [Shard(0)]) for n, t in full.items()}
        refit_engine_(None, src, engine, delta=True)
        _check(engine, want, ptrs)
        served = want


def test_staged_and_delta_refits_from_the_trainers_tensors():
    run_ranks(_staged_and_delta, 2, timeout=90)

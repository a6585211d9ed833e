"""An RL loop on CPU: a transformers Qwen3 (and a Qwen3-MoE) trained by FSDP2 on two gloo
ranks (f32 masters, Adam at an RL learning rate, 1e-6 by default), an engine on two others
holding vLLM's tensor-parallel buffers in bf16, a refit after every step.

    python python/examples/rl_loop.py --steps 5            # Qwen3, then Qwen3-MoE
    python python/examples/rl_loop.py --steps 5 --delta    # refits that send what changed
    reshard launch --nproc 4 --hosts 2 --link 2gbit --exec -- python python/examples/rl_loop.py --delta

Each step the engine samples a few tokens per prompt with a model built on its shards; the
trainer takes a policy-gradient step on them (reward: the share of tokens in the lower half
of the vocabulary); then the trainer's FSDP2 parameters refit into the engine's buffers
(:func:`reshard.engine.refit_engine_`). After every refit the engine's logits on the batch
must equal the trainer's bit for bit (``--engine-dtype f32``), or with a bf16 engine its
weights must equal the trainer's cast to bf16 bit for bit (as torch's ``.to()`` rounds), or
the loop stops. Each step prints the share of the engine's weights that changed, the refit's time,
the pause (the engine waiting: refit and rebuilding its model) and, measured in the same
run, what the usual way costs: per-parameter ``full_tensor()`` on the trainer and a
broadcast to every rank.

With ``--delta`` every refit runs on one :class:`reshard.torch.DeltaSession` kept across the
steps: the first is dense, each later one sends only the blocks that changed since the last,
and the line adds the bytes sent against the dense refit's (summed over the senders, from
the :class:`reshard.torch.DeltaReport`) and the share of the elements that changed.

Started by a launcher that sets ``RANK``, ``WORLD_SIZE`` (4), ``MASTER_ADDR`` and
``MASTER_PORT`` (``reshard launch --exec``, torchrun), each process runs its own rank: so the
loop runs across emulated hosts too (ranks 0-1 train on one, 2-3 serve on the other).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import time

import torch
import torch.distributed as dist

TRAIN_RANKS = [0, 1]
ENGINE_RANKS = [2, 3]
WORLD = 4


def _config(moe: bool, args):
    hidden = args.hidden
    small = dict(
        vocab_size=args.vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        tie_word_embeddings=False,
        max_position_embeddings=64,
    )
    if moe:
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden // 2, **small
        )
    from transformers import Qwen3Config

    return Qwen3Config(**small)


def _model(config):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)  # the same initial weights on every rank
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def _assemble(refit, engine, rank, group, vocab_pad=64):
    """The whole HF tensors from the engine ranks' buffers (gathered among them): fused
    buffers split into their members, the padding cut off, each shard put in its place."""
    from reshard.engine import table

    everyone = [None] * len(ENGINE_RANKS)
    dist.all_gather_object(everyone, engine, group=group)
    names = set(refit.names)
    full = {}
    for r, theirs in zip(ENGINE_RANKS, everyone):
        fused = refit.fused(r)
        pieces, at = {}, {}
        for name, tensor in theirs.items():
            refit_name = table.refit_name(names, name, "weight_scale_inv")
            if refit_name in fused:
                for member, dim, offset, extent in fused[refit_name]:
                    pieces[member] = tensor.narrow(dim, offset, extent)
                continue
            layout = refit.layouts(refit_name)[1]
            if refit_name in table.VOCAB:  # the padded split: its real rows, where they start
                first, real, _ = table.padded(layout, r, vocab_pad)
                pieces[refit_name] = tensor[:real]
                at[refit_name] = first
            else:
                pieces[refit_name] = tensor
        for name, piece in pieces.items():
            layout = refit.layouts(name)[1]
            if name not in full:
                full[name] = torch.empty(layout.shape, dtype=piece.dtype)
            offset, _ = layout.local_region(r)
            offset = [at.pop(name, offset[0]), *offset[1:]]
            full[name][tuple(slice(o, o + n) for o, n in zip(offset, piece.shape))] = piece
    return full


def _hf_state(refit, full, model):
    """The model's state dict from whole refit tensors (transformers 5's fused experts)."""
    state = {}
    for name in model.state_dict():
        if name in full:
            state[name] = full[name]
        elif name.endswith(".mlp.experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            gate, up = full[prefix + "gate_proj.weight"], full[prefix + "up_proj.weight"]
            state[name] = torch.cat([gate, up], dim=1)
    return state


def _run_model(rank, args, moe: bool, world_group, engine_group, train_mesh, path_dir) -> None:
    import reshard.torch as rt
    from reshard import Refit
    from reshard.engine import engine_params, refit_engine_
    from torch.distributed.fsdp import fully_shard

    config = _config(moe, args)
    model = _model(config)
    kind = "qwen3_moe" if moe else "qwen3"
    path = os.path.join(path_dir, f"{kind}.json")
    if rank == 0:
        config.save_pretrained(path_dir)
        os.replace(os.path.join(path_dir, "config.json"), path)
    dist.barrier()
    dtype = {"bf16": torch.bfloat16, "f32": torch.float32}[args.engine_dtype]
    refit = Refit(path, "fsdp=2", f"tp={len(ENGINE_RANKS)}", train_dtype="f32", infer_dtype=args.engine_dtype)
    trainer = engine = None
    if rank in TRAIN_RANKS:
        for layer in model.model.layers:
            fully_shard(layer, mesh=train_mesh)
        fully_shard(model, mesh=train_mesh)
        optim = torch.optim.Adam(model.parameters(), lr=args.lr)
        trainer = model
    else:
        engine = {n: torch.zeros(s, dtype=d) for n, (s, d) in engine_params(refit, rank).items()}
        engine_model = model.to(dtype)
    src = dict(trainer.named_parameters()) if trainer is not None else None
    delta = rt.DeltaSession() if args.delta else None  # one session across the steps
    gen = torch.Generator().manual_seed(1234)
    prompts = torch.randint(0, args.vocab, (args.batch, 4), generator=gen)
    baseline, served = {}, None
    if rank in ENGINE_RANKS:
        for name in refit.names:
            baseline[name] = torch.empty(refit.layouts(name)[1].shape)
    for step in range(args.steps + 1):
        # the refit, timed on every rank; the pause lasts until the engine's model is rebuilt
        dist.barrier()
        start = time.perf_counter()
        report = refit_engine_(refit, src, engine, delta=delta)
        refit_s = time.perf_counter() - start
        full = None
        if engine is not None:
            full = _assemble(refit, engine, rank, engine_group)
            engine_model.load_state_dict(_hf_state(refit, full, engine_model), strict=True)
        pause_s = time.perf_counter() - start
        changed = torch.zeros(2, dtype=torch.float64)  # elements changed, elements
        if full is not None and rank == ENGINE_RANKS[0]:
            bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
            for name, tensor in full.items():
                changed[1] += tensor.numel()
                if served is not None:
                    changed[0] += (tensor.view(bits) != served[name].view(bits)).sum()
            served = full
        # the usual way, same run: per-parameter full_tensor() on the trainer, a broadcast
        dist.barrier()
        start = time.perf_counter()
        for name in refit.names:
            if trainer is not None:
                whole = _full_tensor(src, name)
            else:
                whole = baseline[name]
            dist.broadcast(whole, TRAIN_RANKS[0], group=world_group)
            if full is not None and not torch.equal(whole.to(dtype).view(-1), full[name].view(-1)):
                raise SystemExit(f"{kind} step {step}: the engine's {name} is not the trainer's in {dtype}")
        naive_s = time.perf_counter() - start
        # the engine samples from the prompts with the refit weights; everyone gets the tokens
        tokens = prompts.clone()
        if rank == ENGINE_RANKS[0]:
            with torch.no_grad():
                for _ in range(args.tokens):
                    logits = engine_model(tokens).logits[:, -1]
                    probs = torch.softmax(logits, dim=-1)
                    tokens = torch.cat([tokens, torch.multinomial(probs, 1, generator=gen)], dim=1)
        else:
            tokens = torch.cat([tokens, torch.zeros(args.batch, args.tokens, dtype=tokens.dtype)], dim=1)
        dist.broadcast(tokens, ENGINE_RANKS[0])
        # the engine's logits on the batch against the trainer's, bit for bit
        with torch.no_grad():
            if trainer is not None:
                logits = trainer(tokens).logits
            else:
                logits = engine_model(tokens).logits
        theirs = logits.clone().float()
        dist.broadcast(theirs, TRAIN_RANKS[0])
        if dtype == torch.float32:
            equal = torch.tensor([int(torch.equal(theirs, logits))])
            dist.all_reduce(equal, op=dist.ReduceOp.MIN)
            if not equal.item():
                raise SystemExit(f"{kind} step {step}: the engine's logits differ from the trainer's")
        times = torch.tensor([refit_s, pause_s, naive_s], dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        dist.all_reduce(changed)
        if step == args.steps:
            loss_text = "(last refit)"
        else:
            optimizer = optim if trainer is not None else None
            reward = _train_step(trainer, optimizer, tokens, prompts.shape[1], args.vocab)
            loss_text = f"reward {reward:.3f}"
        delta_text = _delta_text(refit, report) if args.delta else ""
        share = "first" if step == 0 else f"{changed[0] / changed[1]:.2%}"
        verdict = "logits bitwise equal"
        if dtype != torch.float32:
            verdict = f"weights bitwise equal ({args.engine_dtype})"
        if rank == 0:
            print(
                f"{kind:9} step {step}  {loss_text:16} changed {share:>6}  refit {times[0] * 1e3:7.2f} ms  "
                f"pause {times[1] * 1e3:7.2f} ms  "
                f"full_tensor+broadcast {times[2] * 1e3:7.2f} ms  ({times[2] / times[0]:.1f}x)  {delta_text}"
                f"{verdict}",
                flush=True,
            )


def _delta_text(refit, report):
    """The delta refit's bytes sent against the dense refit's and the share of elements
    changed, summed over every rank's report (each counts what it sent); on every rank."""
    counts = torch.tensor([report.bytes_sent, report.bytes_dense, report.changed], dtype=torch.float64)
    dist.all_reduce(counts)
    sent, dense, changed = counts.tolist()
    elements = dense / refit.layouts(refit.names[0])[1].elem_bytes
    if report.base is None:
        return f"delta: dense {sent / 1e3:.1f} kB (first refit)  "
    return (
        f"delta: sent {sent / 1e3:.1f} of {dense / 1e3:.1f} kB ({sent / dense:.1%}), "
        f"{changed / elements:.1%} changed  "
    )


def _full_tensor(src, name):
    if name in src:
        return src[name].full_tensor()
    # a member of transformers 5's fused experts: its part of the whole buffer
    prefix, member = name.rsplit(".", 2)[0], name.rsplit(".", 2)[1]
    whole = src[prefix + ".gate_up_proj"].full_tensor()
    half = whole.shape[1] // 2
    return (whole[:, :half] if member == "gate_proj" else whole[:, half:]).contiguous()


def _train_step(trainer, optim, tokens, prompt_len, vocab):
    """One policy-gradient step (REINFORCE with a mean baseline) on the sampled tokens."""
    sampled = tokens[:, prompt_len:]
    rewards = (sampled < vocab // 2).float().mean(dim=1)
    if trainer is None:
        return rewards.mean().item()
    advantage = rewards - rewards.mean()
    logits = trainer(tokens).logits[:, prompt_len - 1 : -1]
    logp = torch.log_softmax(logits, dim=-1).gather(-1, sampled.unsqueeze(-1)).squeeze(-1)
    loss = -(advantage.unsqueeze(1) * logp).mean()
    optim.zero_grad()
    loss.backward()
    optim.step()
    return rewards.mean().item()


def _worker(rank, args, port, path_dir):
    from torch.distributed.tensor import DeviceMesh

    if port is not None:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    import datetime

    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=120))
    try:
        world_group = dist.group.WORLD
        engine_group = dist.new_group(ENGINE_RANKS)
        train_mesh = DeviceMesh("cpu", TRAIN_RANKS)
        for moe in args.models:
            _run_model(rank, args, moe, world_group, engine_group, train_mesh, path_dir)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="training steps (a refit after each)")
    parser.add_argument("--tokens", type=int, default=4, help="tokens sampled per prompt")
    parser.add_argument("--batch", type=int, default=4, help="prompts per step")
    parser.add_argument("--vocab", type=int, default=1000, help="vocabulary (padded to 1024 by the engine)")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size (a multiple of 8)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers")
    parser.add_argument("--lr", type=float, default=1e-6, help="Adam's learning rate")
    parser.add_argument(
        "--engine-dtype",
        choices=["bf16", "f32"],
        default="bf16",
        help="the engine's weights (the trainer's are f32)",
    )
    parser.add_argument("--model", choices=["qwen3", "qwen3_moe", "both"], default="both")
    parser.add_argument(
        "--delta", action="store_true", help="refit by delta (one DeltaSession, the first dense)"
    )
    args = parser.parse_args(argv)
    args.models = {"qwen3": [False], "qwen3_moe": [True], "both": [False, True]}[args.model]
    import torch.multiprocessing as mp

    if "RANK" in os.environ:  # started by a launcher: this process is one rank
        if int(os.environ.get("WORLD_SIZE", "0")) != WORLD:
            given = os.environ.get("WORLD_SIZE")
            raise SystemExit(f"WORLD_SIZE: {given!r}, but the loop runs on {WORLD} ranks")
        path_dir = os.path.join(tempfile.gettempdir(), f"rl-loop-{os.environ['MASTER_PORT']}")
        os.makedirs(path_dir, exist_ok=True)
        _worker(int(os.environ["RANK"]), args, None, path_dir)
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as path_dir:
        mp.spawn(_worker, args=(args, port, path_dir), nprocs=WORLD, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

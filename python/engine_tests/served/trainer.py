"""One rank of a separate trainer job that refits a running ``vllm serve`` through vLLM's own
trainer API, and judges each round by the server's own answers.

``python trainer.py URL MODEL_DIR OPTIONS_JSON`` under ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/
``MASTER_PORT`` (two ranks shard the model with FSDP2; one rank holds it whole). The trainer
starts from the checkpoint the server serves, takes f32 Adam steps, and after each round
sends its weights (``send_weights``). Rank 0 then asks the server for greedy completions of a
few prompts and compares them, token for token, with transformers' greedy ``generate`` on the
trainer's weights of the version the server must serve (the round's, or the last committed
one after an abort). One JSON line per round on standard output: ``{"round", "equal",
"changed", "report"}``.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

PROMPTS = [[5, 6, 7, 8], [40, 41, 42], [100, 7, 250, 9, 31], [300, 301]]
TOKENS = 8


def completions(url: str, model_dir: str):
    import requests

    out = []
    for prompt in PROMPTS:
        answer = requests.post(
            f"{url}/v1/completions",
            json={
                "model": model_dir,
                "prompt": prompt,
                "max_tokens": TOKENS,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            },
            timeout=120,
        )
        answer.raise_for_status()
        out.append(answer.json()["choices"][0]["token_ids"])
    return out


def generate(reference, state):
    """transformers' greedy completions of the prompts with the weights ``state``."""
    reference.load_state_dict(state, strict=False)
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = reference.generate(
                torch.tensor([prompt]), max_new_tokens=TOKENS, do_sample=False, pad_token_id=0
            )
            out.append(ids[0, len(prompt) :].tolist())
    return out


def full_state(model):
    """The whole tensors of the trainer's weights (a collective under FSDP2), for the oracle."""
    out = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = full.detach().clone()
    return out


def main() -> None:
    import transformers
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.plugins import load_general_plugins

    from reshard.vllm_backend import ReshardTrainerInitInfo

    url, model_dir, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    torch.manual_seed(1234)  # the same steps on every rank
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    reference.generation_config.eos_token_id = None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=options.get("lr", 0.02))
    load_general_plugins()  # the backend's trainer side, from the package's entry point
    info = ReshardTrainerInitInfo(
        rank=rank,
        train=f"fsdp={world}" if world > 1 else "tp=1",
        delta=options.get("delta", False),
        staged=options.get("staged", False),
        checksum=options.get("checksum", False),
        timeout_s=options.get("timeout_s", 60.0),
    )
    trainer = WeightTransferTrainerFactory.trainer_init(
        info, client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(model)
    )
    served = full_state(model)
    previous = generate(reference, served) if rank == 0 else None
    aborts = set(options.get("abort", []))
    for step in range(options.get("rounds", 5)):
        ids = torch.randint(3, 400, (2, 16))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        commit = step not in aborts
        started = time.monotonic()
        report = trainer.send_weights(commit=commit)
        seconds = time.monotonic() - started
        state = full_state(model)
        if commit:
            served = state
        if rank == 0:
            want = generate(reference, served)
            got = completions(url, model_dir)
            line = {
                "round": step,
                "commit": commit,
                "equal": got == want,
                "changed": want != previous,
                "seconds": seconds,
                "report": report,
            }
            if got != want:
                line["got"], line["want"] = got, want
            print(json.dumps(line), flush=True)
            previous = want
    if world > 1:
        dist.barrier()
    trainer.shutdown()


if __name__ == "__main__":
    main()

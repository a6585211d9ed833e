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


class Stream:
    """Requests one after another on a thread, each a short greedy completion: the longest gap
    between two answers while a round runs is the pause the server's clients saw."""

    def __init__(self, url: str, model_dir: str) -> None:
        import threading

        self.url, self.model_dir = url, model_dir
        self.done: list = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        import requests

        while not self.stop.is_set():
            try:
                requests.post(
                    f"{self.url}/v1/completions",
                    json={"model": self.model_dir, "prompt": [9, 10, 11], "max_tokens": 2, "temperature": 0},
                    timeout=120,
                ).raise_for_status()
            except Exception:  # noqa: BLE001 - a failed request is a gap too
                continue
            self.done.append(time.monotonic())

    def longest_gap(self, start: float, end: float) -> float:
        """The longest time without an answer between ``start`` and ``end``."""
        times = [start] + [t for t in self.done if start < t < end] + [end]
        later = [t for t in self.done if t >= end]
        if later:
            times[-1] = later[0]  # the gap that was open at the end runs to the next answer
        return max(b - a for a, b in zip(times, times[1:]))

    def close(self) -> None:
        self.stop.set()
        self.thread.join(30)


def die_at(stage: str) -> None:
    """The trainer killed (SIGKILL) when its side of ``stage`` begins: ``prepare`` (the
    workers are in their prepare, waiting for its bytes) or ``decision`` (they wait for the
    job's decision, whose coordinator is this job's rank 0)."""
    import signal

    from reshard import engine

    name = {"prepare": "prepare_engine_", "decision": "commit_engine_"}[stage]
    real = getattr(engine, name)

    def dying(*args, **kwargs):
        if args and args[0] is not None:  # the trainer's own call
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)

    setattr(engine, name, dying)


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
    steps = options.get("steps", 1)  # optimizer steps per round
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
    if options.get("die_at"):
        die_at(options["die_at"])
    judged = options.get("judge", True) is True
    served = full_state(model) if judged else None
    stream = Stream(url, model_dir) if rank == 0 and options.get("stream") else None
    previous = generate(reference, served) if rank == 0 and judged else None
    if options.get("judge") == "reload" and rank == 0:
        previous = completions(url, model_dir)
    aborts = set(options.get("abort", []))
    for step in range(options.get("rounds", 5)):
        for _ in range(steps):
            ids = torch.randint(3, 400, (2, 16))
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        commit = step not in aborts
        started = time.monotonic()
        if options.get("method") == "broadcast":
            report = trainer.broadcast_weights()
        else:
            report = trainer.send_weights(commit=commit)
        ended = time.monotonic()
        seconds = ended - started
        if stream is not None:
            time.sleep(0.5)  # the answer that ends the last gap
            report["longest_gap_s"] = stream.longest_gap(started, ended)
        if judged:
            state = full_state(model)
            if commit:
                served = state
        if options.get("judge") == "reload":
            # vLLM's own reload of the same weights is the oracle (a bf16 server, whose
            # arithmetic is not transformers'): the answers after reshard's round, then after
            # the same weights whole through vLLM's reload, must be the same tokens
            got = completions(url, model_dir) if rank == 0 else None
            trainer.broadcast_weights()
            if rank == 0:
                want = completions(url, model_dir)
                line = {"round": step, "commit": commit, "equal": got == want, "seconds": seconds}
                line["changed"], line["report"] = want != previous, report
                if got != want:
                    line["got"], line["want"] = got, want
                print(json.dumps(line), flush=True)
                previous = want
        elif rank == 0 and not judged:
            line = {"round": step, "commit": commit, "seconds": seconds, "report": report}
            print(json.dumps(line), flush=True)
        elif rank == 0:
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
    if stream is not None:
        stream.close()
    if world > 1:
        dist.barrier()
    trainer.shutdown()


if __name__ == "__main__":
    main()

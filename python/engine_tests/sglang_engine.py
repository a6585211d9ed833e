"""SGLang's own model classes built on the CPU over gloo, as an engine rank of a refit.

The way SGLang's scheduler process brings one tensor-parallel rank up: its server arguments
(``device="cpu"``, dummy weights) published as the process's runtime context, its parallel
bootstrap (``torch.distributed`` over gloo from ``MASTER_ADDR``/``MASTER_PORT``), then its
loader's ``_initialize_model`` under the model's dtype. Made to run on a CPU by:

- ``SGLANG_CPU_OMP_THREADS_BIND``: one core per rank (the bootstrap wants one entry a rank);
- ``SGLANG_NCCL_SO_PATH`` naming no file, so that no PyNccl communicator is made (it wants a
  CUDA device);
- ``SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE=env://``: the launcher's address and port;
- the rotary embedding told it runs on the CPU (it imports a GPU kernel library otherwise;
  it holds no parameters, so the weights are SGLang's own either way).
"""

import os


def _cpu_env(world: int) -> None:
    os.environ.setdefault("SGLANG_CPU_OMP_THREADS_BIND", "|".join(str(r) for r in range(world)))
    os.environ.setdefault("SGLANG_NCCL_SO_PATH", os.path.join(os.path.dirname(__file__), "no-nccl.so"))
    os.environ.setdefault("SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE", "env://")


def build(model_dir: str, world: int, rank: int, dtype: str = "bfloat16", custom_weight_loader=()):
    """SGLang's model for ``model_dir`` at tensor parallelism ``world`` on this rank, its weights
    dummy, ``custom_weight_loader`` its server argument. Returns (server args, model config,
    model); torch.distributed is initialised over gloo (env://) by SGLang itself."""
    _cpu_env(world)
    import torch
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import bootstrap
    from sglang.srt.layers.rotary_embedding import base as rotary
    from sglang.srt.model_loader.loader import _initialize_model
    from sglang.srt.model_loader.utils import set_default_torch_dtype
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    rotary._is_cpu = True
    server_args = ServerArgs(
        model_path=model_dir,
        device="cpu",
        tp_size=world,
        dtype=dtype,
        load_format="dummy",
        skip_tokenizer_init=True,
        custom_weight_loader=list(custom_weight_loader) or None,
    )
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=rank, gpu_id=rank))
    bootstrap.init_parallel_runtime(server_args=server_args, device="cpu", dist_port=0)
    model_config = ModelConfig.from_server_args(server_args)
    with set_default_torch_dtype(getattr(torch, dtype)), torch.device("cpu"):
        model = _initialize_model(model_config, LoadConfig(load_format="dummy"))
    return server_args, model_config, model

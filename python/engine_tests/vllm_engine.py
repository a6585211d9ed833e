"""vLLM's own model classes built on the CPU over gloo, as an engine rank of a refit."""

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def build(model_dir: str, world: int, rank: int, dtype: str = "bfloat16", ep: bool = False):
    """vLLM's model for ``model_dir`` at tensor parallelism ``world`` on this rank, its weights
    dummy; torch.distributed is initialised over gloo (env://) by vLLM itself."""
    import torch
    from vllm.config import (
        DeviceConfig,
        LoadConfig,
        ModelConfig,
        ParallelConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    cfg = VllmConfig(
        model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True, enforce_eager=True, dtype=dtype),
        parallel_config=ParallelConfig(
            tensor_parallel_size=world,
            distributed_executor_backend="external_launcher",
            enable_expert_parallel=ep,
        ),
        device_config=DeviceConfig("cpu"),
        load_config=LoadConfig(load_format="dummy"),
    )
    with set_current_vllm_config(cfg):
        init_distributed_environment(world, rank, "env://", rank, "gloo")
        ensure_model_parallel_initialized(world, 1)
        with set_default_torch_dtype(cfg.model_config.dtype), torch.device("cpu"):
            model = initialize_model(cfg)
    return cfg, model

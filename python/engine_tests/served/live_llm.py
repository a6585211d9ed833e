"""The worker and the model of vLLM's offline ``LLM`` run in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), as vLLM 0.32's CPU build holds them."""


def worker_of(llm):
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker


def served_model_of(llm):
    return worker_of(llm).model_runner.get_model()

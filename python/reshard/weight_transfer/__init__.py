"""reshard as vLLM's weight-transfer backend, by part (the plugin itself is
:mod:`reshard.vllm_backend`, which gathers them):

- :mod:`.info`: what the two sides tell each other (init and update infos, phases);
- :mod:`.worker`: the worker's side (:class:`ReshardWeightTransferEngine`);
- :mod:`.served_model`: the model as ``vllm serve`` runs it, beside its loader-format mirror;
- :mod:`.trainer`: the trainer's side (:class:`ReshardTrainer`);
- :mod:`.colocated`: the weight-sync client of a worker in the trainer's process;
- :mod:`.routes`: the HTTP middleware for the server's routes.
"""

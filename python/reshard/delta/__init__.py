"""Delta refits of torch tensors (:class:`reshard.torch.DeltaSession`), one module per part.

- :mod:`.format`: the wire format of a delta message, shared by both codec paths;
- :mod:`.codec`: encoding and applying a region against its base (the core's codec on the CPU);
- :mod:`.device`: the same on other devices, with torch operations;
- :mod:`.exchange`: one refit's data: encode, exchange point to point, apply;
- :mod:`.refit`: one refit: the fence, then the exchange, and its report;
- :mod:`.session`: :class:`DeltaSession`, the bases and versions kept across refits;
- :mod:`.stage`: staged refits (prepare, commit, abort) beside the live shards.
"""

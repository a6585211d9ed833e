"""The plain path of :mod:`reshard.torch`, one module per part.

- :mod:`.checks`: what every part checks alike (a layout's torch dtype, a rank's tensors
  against its shards, the group's ranks) and the group's agreement on the job;
- :mod:`.arguments`: the arguments of ``reshard_many_``, read on each rank before the agreement;
- :mod:`.cast`: float casts at the source;
- :mod:`.bucket`: one bucket's local plans, messages and copying program;
- :mod:`.control`: the job's control plane (the runtime's own links, timeouts, the decision).
"""

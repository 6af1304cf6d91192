"""What more than one test module uses: import it from here, never from another test module.

- ``paths``: the repository's folders and committed files (``ROOT``, ``EXAMPLE_PROFILE``).
- ``ports``: a free TCP port on the loopback interface.
- ``launch``: ``torchrun`` jobs of a worker script under tests/multiprocess/workers/, and the
  environment a worker script needs to import this checkout.
- ``clusters``: hand-built ``ClusterProfile`` objects (identical blocks, zones, random regions).
- ``benchmarks``: a script under benchmarks/ loaded as a module.
- ``models``, ``tied_models``: the small Lightning modules the multi-process tests train.
- ``equivalence``: single-process references and the comparisons of ranks' saved parameters.
- ``executor``: the bare executor's test network, its data and its gradient check.
- ``lab``: the skip (or, in CI, failure) when root and Mininet are missing.
"""

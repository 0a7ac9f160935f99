"""Parallel and memory-bounded execution of trees larger than one device.

- :mod:`.cp`: context parallelism, one packed tree split over a process group;
- :mod:`.depth_first`: bounded-memory depth-first execution on one device;
- :mod:`.balance`: FLOP-balanced assignment of trees to data-parallel ranks, and its imbalance;
- :mod:`.fsdp`: process groups, FSDP2 wrapping, rank plans; :mod:`.memory`: peak-memory probes.

May import: trees, data, attention, models, logprobs, objectives.
"""

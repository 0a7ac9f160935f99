"""Parallel and memory-bounded execution: trees over many ranks, or larger than one device.

- :mod:`.fsdp`: data parallelism with FSDP2 (process setup, sharding from outside the model,
  FLOP-balanced work, one step on N ranks equal to the single-process step);
- :mod:`.cp`: context parallelism, one packed tree split over a process group (its recurrent
  layers split too, :mod:`.cp_recurrent`);
- :mod:`.depth_first`: bounded-memory depth-first execution on one device;
- :mod:`.balance`: FLOP-balanced assignment of trees to data-parallel ranks, and its imbalance;
- :mod:`.memory`: peak activation memory (what autograd saves for backward), on any device.

May import: trees, data, attention, models, logprobs, objectives.
"""

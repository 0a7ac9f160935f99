"""Measuring: ``treetrain bench`` (tree vs the per-path baseline against the FLOP bound),
``treetrain stats`` (what a dataset shares), the allocator re-exec for CPU runs, plots.

May import: everything below it (trees .. integrations); only the CLI imports it.
"""

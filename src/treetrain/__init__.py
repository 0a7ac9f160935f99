"""treetrain: train LLMs on tree-structured agent trajectories."""

__version__ = "0.1.0"

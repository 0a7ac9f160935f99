"""Data: records read from JSONL and tables into trees, validated with errors that name the record.

Holds the field validators (:mod:`.fields`), the record formats (:mod:`.records`: paths, explicit
trees, chat messages, preference pairs), the lazy readers (:mod:`.reader`), chat rendering
(:mod:`.chat`), the offline Qwen tokenizer (:mod:`.qwen`), preference records
(:mod:`.preference`), table sources (:mod:`.sources`) and TRL's one-completion-per-row layouts
merged by prompt (:mod:`.rows`).

May import: :mod:`treetrain.trees`.
"""

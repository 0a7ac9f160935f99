"""``benchmarks/gui_agent.py``: TRL's per-path step computes the tree's loss, the bounds and the run's
FLOPs add up, and ``--quick`` runs end to end (timings are not checked)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

pytest.importorskip("trl")

from benchmarks import gui_agent  # noqa: E402
from treetrain.bench import cases as bench  # noqa: E402


def test_trl_step_is_the_tree_step(tmp_path):
    """The same token-mean loss over the actions, from TRL's per-path scoring and from the tree."""
    a = gui_agent.parse_args(["--quick"])
    model, tree = gui_agent.gui_model(a), gui_agent.episode(a)
    trainer = gui_agent.trl_trainer(model, str(tmp_path))
    assert not trainer.args.activation_checkpointing and not trainer.args.gradient_checkpointing
    rows = gui_agent.trl_rows(a)
    assert len(rows) == tree.num_paths and [r["num_images"] for r in rows] == [[1], [1], [2], [2], [3], [3]]
    trl = gui_agent.trl_step(trainer, rows, a.text)
    model.zero_grad(set_to_none=True)
    micro = bench.prepare("tree", [tree], tree.num_tokens)
    assert trl == pytest.approx(bench.train_step("tree", model, [tree], micro, None), rel=1e-5)


def test_bounds_and_run_flops():
    a = gui_agent.parse_args(["--quick"])
    tree = gui_agent.episode(a)
    work = {"baseline": gui_agent.baseline_work([tree], 14), "tree": gui_agent.tree_work([tree], 14)}
    trl = gui_agent.trl_work(work)
    assert trl.recomputed == trl.targets == work["baseline"].targets == a.text * tree.num_paths
    assert (trl.tokens, trl.images) == (work["baseline"].tokens, work["baseline"].images)
    # log-prob check 0.4 + warm-up chunk 1/7 + 2 rounds + live peak; tree: 0.4 + warm-up + 2 x 8 + live peak
    assert gui_agent.run_steps(2, 7) == pytest.approx(
        {"baseline": 3.4 + 1 / 7, "tree": 18.4, "trl": 2 + 1 / 7}
    )
    assert gui_agent.run_flops(2, 1, 10.0, 1.0, 11.0, 7) == pytest.approx(
        (6.4 + 1 / 7) * 10 + 18.4 + (2 + 1 / 7) * 11
    )
    budgets = gui_agent.baseline_budgets(tree, tree.num_tokens)
    assert budgets[0] == tree.num_tokens and len(set(budgets)) == len(budgets) <= 3


def test_chunks_make_up_the_whole_step(tmp_path):
    """The baseline's and TRL's chunks: every micro-batch / row once, in order, and their losses sum to
    the whole step's (the tree's loss)."""
    a = gui_agent.parse_args(["--quick"])
    model, tree = gui_agent.gui_model(a), gui_agent.episode(a)
    trainer = gui_agent.trl_trainer(model, str(tmp_path))
    units = bench.micro_units("sequence", [tree], bench.ONE_PATH)
    assert len(units) == tree.num_paths and all(len(u) == 1 for u in units)
    steps = gui_agent.chunked_steps(
        a, model, tree, units, trainer, gui_agent.CostModel.from_config(model.config), None
    )
    assert 1 < len(steps["baseline"]) < tree.num_paths and 1 < len(steps["trl"]) < tree.num_paths
    whole = bench.train_step("tree", model, [tree], bench.prepare("tree", [tree], tree.num_tokens), None)
    for mode in ("baseline", "trl"):
        assert sum(chunk() for chunk in steps[mode]) == pytest.approx(whole, rel=1e-5), mode


def test_quick_runs(capsys):
    torch.manual_seed(0)
    assert gui_agent.main(["--quick", "--allocator", "system"]) == 0
    out = capsys.readouterr().out
    assert "| baseline (one path per forward) |" in out and "| TRL GRPOTrainer, best configuration |" in out
    assert "Live peak (tensors alive at once in one step): baseline" in out
    assert "- round 1: tree steps" in out


def test_rejudge_renders_the_record_from_its_json_alone(tmp_path):
    """A run's .json holds what its record says: ``--rejudge`` rewrites the .md and the rows from it (here
    3 rounds of a steady machine, TRL's chunks a stall in round 2: the rounds spread, the chunk medians
    and the verdict do not); a record without its preamble is refused by name."""
    from benchmarks import gui_record

    tree = [[10.0, 10.0, 10.0]] * 3
    data = {
        "preamble": "# GUI agent: screenshots in a tree\n\nprovenance line",
        "names": {"baseline": "baseline (one path per forward)", "trl": "TRL"},
        "before": {"line": "load average 0.1", "busy": []},
        "tree": tree,
        "times": {"baseline": [[30.0, 40.0]] * 3, "trl": [[30.0, 40.0], [60.0, 40.0], [30.0, 40.0]]},
        "losses": {"tree": 1.0, "baseline": 1.0, "trl": 1.0 + 2e-4},
        "load": {"cores": 2, "wall_s": 600.0, "loadavg": 1.0, "others_cores": 0.0, "steal": 0.01},
        "peaks": {"sequence": 10.0, "tree": 8.0},
        "flops": {"baseline": 7e12, "tree": 1e12, "trl": 7e12},
    }
    path = tmp_path / "gui_agent_x.json"
    path.write_text(gui_agent.json.dumps(data))
    assert gui_agent.main(["--rejudge", str(path)]) == 0
    text = path.with_suffix(".md").read_text()
    assert text.startswith("# GUI agent: screenshots in a tree\n\nprovenance line\n\n## Timing")
    assert "| baseline (one path per forward) | 7.00x | 7.00x-7.00x | 7.00x | **1.00** (1.00-1.00) " in text
    assert "| TRL | 7.00x | 7.00x-10.00x | 7.00x | **1.00** (1.00-1.43) | 7.00, 10.00, 7.00 (43%) " in text
    assert "**NOT TRUSTWORTHY: 1 of 2 rows**" in text and "- TRL: trl: the speedup's 90% interval" in text
    rows = gui_agent.json.loads(path.read_text())["modes"]
    assert rows["baseline"]["untrusted"] == [] and rows["trl"]["speedups"] == [7.0, 10.0, 7.0]
    assert "Load while timed: " in text and "in one step): baseline 10 MiB, tree 8 MiB." in text
    data["reading"] = "## Reading (by hand)\n\nThe stall was mine."
    path.write_text(gui_agent.json.dumps(data))
    assert gui_record.rejudge(path).endswith("\n## Reading (by hand)\n\nThe stall was mine.")
    del data["preamble"]
    path.write_text(gui_agent.json.dumps(data))
    with pytest.raises(ValueError, match="gui_agent_x.json: no preamble"):
        gui_record.rejudge(path)


def test_peaks_into_a_record(tmp_path):
    """``--peaks-into``: the live peaks of a recorded run's preset, measured alone and added to its record;
    a record of another preset is refused (its baseline FLOPs differ)."""
    a = gui_agent.parse_args(["--quick"])
    model, tree = gui_agent.gui_model(a), gui_agent.episode(a)
    cost = gui_agent.CostModel.from_config(model.config)
    vocab = model.config.get_text_config().vocab_size
    base_f, tree_f, _ = bench.case_flops([tree], tree.num_tokens, cost, vocab)
    data = {
        "preamble": "# GUI agent", "names": {"baseline": "baseline"},
        "before": {"line": "idle", "busy": []}, "tree": [[1.0, 1.0]] * 3,
        "times": {"baseline": [[5.0]] * 3}, "losses": {"tree": 1.0, "baseline": 1.0},
        "flops": {"baseline": base_f, "tree": tree_f}, "baseline_capacity": bench.ONE_PATH, "peaks": None,
    }  # fmt: skip
    path = tmp_path / "gui_agent_x.json"
    path.write_text(gui_agent.json.dumps(data))
    assert gui_agent.main(["--quick", "--allocator", "system", "--peaks-into", str(path)]) == 0
    peaks = gui_agent.json.loads(path.read_text())["peaks"]
    assert set(peaks) == {"sequence", "tree"} and all(v > 0 for v in peaks.values())
    assert f"baseline {peaks['sequence']:,.0f} MiB" in path.with_suffix(".md").read_text()
    data["flops"]["baseline"] *= 2
    path.write_text(gui_agent.json.dumps(data))
    with pytest.raises(ValueError, match="recorded for another preset"):
        gui_agent.main(["--quick", "--allocator", "system", "--peaks-into", str(path)])

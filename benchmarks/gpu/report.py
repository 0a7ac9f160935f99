"""Part 5, the report: ``kernel_time_vs_T.png`` and ``summary.md`` from the other parts' results,
with the issue's acceptance checks (every correctness check passes, Triton at least as fast as
FlexAttention on every kernel case, end-to-end efficiency >= 0.9 of the FLOP bound; 0.95 the goal).
Rewritten on every run, so it always reflects what the folder holds.
"""

from __future__ import annotations

from pathlib import Path

from .runner import load_records, part_status

PLOT = "kernel_time_vs_T.png"
SUMMARY = "summary.md"
EFFICIENCY_MIN, EFFICIENCY_GOAL = 0.9, 0.95


def plot_kernels(records: list[dict], path: Path) -> bool:
    """Forward + backward time vs T, one panel per tree kind, one line per row name (log-log)."""
    rows = [r for r in records if r.get("rows") and not r["id"].startswith("triton block sweep")]
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = sorted({r["tree"] for r in rows})
    fig, axes = plt.subplots(1, len(kinds), figsize=(5.5 * len(kinds), 4), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        lines: dict[str, list[tuple[int, float]]] = {}
        for r in sorted((r for r in rows if r["tree"] == kind), key=lambda r: r["T"]):
            for row in r["rows"]:
                if "ms" in row:
                    label = f"{row['name']} (Hq={r['hq']}, D={r['d']})"
                    lines.setdefault(label, []).append((r["T"], row["ms"]))
        for label, pts in lines.items():
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tree tokens T")
        ax.set_ylabel("forward + backward (ms)")
        ax.set_title(f"{kind} trees")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _fmt(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def correctness_section(records: list[dict]) -> tuple[list[str], list[str]]:
    """Table lines and the failed checks."""
    lines = ["| case | backend | verdict | worst err / bound | errors (rel. max) | error scale |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    failed = []
    for r in records:
        for b, c in (r.get("backends") or {None: r}).items():
            if "err" in c:
                worst = max(c["err"][n] / c["bound"][n] for n in c["err"])
                errs = ", ".join(f"{n} {v:.1e}" for n, v in c["err"].items())
                scale = ", ".join(f"{n} {v:.1e}" for n, v in c["scale"].items())
                verdict = "pass" if c["ok"] else "**FAIL**"
            else:
                worst, errs, scale = None, c.get("error") or c.get("unavailable") or r.get("error", ""), ""
                verdict = "unavailable" if "unavailable" in c else f"**{r.get('status', 'error').upper()}**"
            if verdict not in ("pass", "unavailable"):
                failed.append(r["id"] + (f" [{b}]" if b else ""))
            lines.append(f"| {r['id']} | {b or '-'} | {verdict} | {_fmt(worst)} | {errs} | {scale} |")
    return lines, failed


def kernels_section(records: list[dict]) -> tuple[list[str], list[str], int]:
    """Table lines (one row per case: ms, TFLOP/s and fraction of the dense peak per kernel), the
    cases where Triton is slower than FlexAttention, and how many cases timed both."""
    names = list(dict.fromkeys(row["name"] for r in records for row in r.get("rows", [])))
    lines = ["| case | allowed / causal pairs | " + " | ".join(f"{n}: ms (TFLOP/s, of peak)" for n in names)
             + " | Flex time / Triton time |", "|---|---|" + "---|" * len(names) + "---|"]  # fmt: skip
    slower, compared = [], 0
    for r in records:
        by_name = {row["name"]: row for row in r.get("rows", [])}
        cells = []
        for n in names:
            row = by_name.get(n)
            if row is None:
                cells.append("-")
            elif "ms" in row:
                cells.append(f"{row['ms']:.3f} ({row['tflops']:.3g}, {_fmt(row.get('of_peak'))})")
            else:
                cells.append(f"**error**: {row['error'][:80]}")
        if not r.get("rows"):
            cells = [f"**{r.get('status')}**: {r.get('error', '')[:80]}"] + [""] * (len(names) - 1)
        ratio = r.get("triton_speedup_over_flex")
        pairs = f"{r['allowed_pairs'] / r['causal_pairs']:.3f}" if "allowed_pairs" in r else "-"
        lines.append(f"| {r['id']} | {pairs} | " + " | ".join(cells) + f" | {_fmt(ratio)} |")
        if ratio is not None:
            compared += 1
            if ratio < 1:
                slower.append(f"{r['id']} (Triton takes {1 / ratio:.2f}x Flex's time)")
    return lines, slower, compared


def e2e_section(records: list[dict]) -> tuple[list[str], list[str]]:
    lines = ["| case | paths | baseline tok | tree tok | bound | speedup | efficiency | MFU base/tree "
             "| tokens/s base/tree | peak MiB base/tree | max lp diff |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    short, profiles = [], []
    for r in records:
        if r.get("status") != "ok":
            lines.append(f"| {r['id']} | **{r.get('status')}**: {r.get('error', '')[:120]} |||||||||| ")
            short.append(r["id"])
            continue
        lines.append(
            f"| {r['name']} | {r['paths']} | {r['baseline_tokens']:,} | {r['computed_tokens']:,} "
            f"| {r['flop_bound']:.2f}x | {r['speedup']:.2f}x | **{r['efficiency']:.2f}** "
            f"| {r['baseline_mfu']:.2f}/{r['tree_mfu']:.2f} "
            f"| {r['baseline_tokens_per_s']:,.0f}/{r['tree_tokens_per_s']:,.0f} "
            f"| {_fmt(r['baseline_peak_mb'], '.0f')}/{_fmt(r['tree_peak_mb'], '.0f')} "
            f"| {r['max_logprob_diff']:.1e} |"
        )
        if r["efficiency"] < EFFICIENCY_MIN:
            short.append(f"{r['name']} (efficiency {r['efficiency']:.2f})")
        if r.get("profile"):
            profiles.append(
                f"- {r['name']}: efficiency {r['efficiency']:.2f} < {EFFICIENCY_GOAL}: `e2e/{r['profile']}`"
            )
    if profiles:
        lines += ["", "Profiles of one step per mode (below the 0.95 goal):", ""] + profiles
    return lines, short


def verl_section(records: list[dict]) -> tuple[list[str], list[str], list[str]]:
    """The main_ppo runs and step 1's metrics side by side; (lines, mismatches, unavailable)."""
    lines, bad, missing = [], [], []
    for r in records:
        if r.get("unavailable"):
            missing.append(r["unavailable"])
        elif r.get("status") != "ok":
            bad.append(f"{r['id']}: {r.get('error', r.get('status'))[:200]}")
        if r.get("rows"):
            lines += ["| metric (step 1) | fsdp2 | treetrain | diff | tolerance |", "|---|---|---|---|---|"]
            lines += [
                f"| {m['metric']} | {m['fsdp2']:.4g} | {m['treetrain']:.4g} | {m['diff']:.2g} "
                f"| {m['tol']:.2g} |"
                for m in r["rows"]
            ]
    lines += [f"- {r['id']}: {r.get('headline') or r.get('status')}" for r in records]
    return lines, bad, sorted(set(missing))


def write(out: Path, header: list[str]) -> dict:
    """Write the plot and the summary; returns the acceptance checks."""
    status = {p: part_status(out, p) for p in ("correctness", "kernels", "e2e", "verl")}
    corr, kern, e2e, verl = (load_records(out, p) for p in ("correctness", "kernels", "e2e", "verl"))
    plotted = plot_kernels(kern, out / PLOT)
    c_lines, failed = correctness_section(corr)
    k_lines, slower, compared = kernels_section(kern)
    e_lines, short = e2e_section(e2e)
    v_lines, verl_bad, verl_missing = verl_section(verl)
    unavailable = sorted({why for r in corr for why in (r.get("unavailable") or {}).values()})
    unavailable += verl_missing

    def verdict(part: str, problems: list[str], what: str, measured: bool = True) -> str:
        st = status[part]["status"]
        if st == "not run" or not measured:
            return f"- {what}: not {'run' if st == 'not run' else 'measured'}"
        done = "" if st == "done" else f" (part {st}: incomplete)"
        return f"- {what}: " + ("yes" if not problems else "**no**: " + "; ".join(problems)) + done

    text = header + [
        "## Acceptance (issue 26)",
        "",
        verdict("correctness", failed, "every correctness check passes"),
        verdict("kernels", slower, "Triton at least as fast as FlexAttention on every case", compared > 0),
        verdict("e2e", short, f"end-to-end efficiency >= {EFFICIENCY_MIN} of the FLOP bound", bool(e2e)),
        verdict(
            "verl",
            verl_bad,
            "verl main_ppo: step 1 of strategy=treetrain = strategy=fsdp2 (bf16 noise)",
            any(r.get("rows") for r in verl) or bool(verl_bad),
        ),
    ]
    text += [f"- not available here: {why}" for why in unavailable]
    text += ["", "## Parts", "", "| part | status | seconds used | cases |", "|---|---|---|---|"]
    text += [
        f"| {p} | {s['status']} | {s.get('used_s', 0):.0f} | {s.get('cases', 0)} |" for p, s in status.items()
    ]
    c_lines, k_lines, e_lines = (
        x if recs else ["not run"] for x, recs in ((c_lines, corr), (k_lines, kern), (e_lines, e2e))
    )
    text += ["", "## 1. Correctness", ""] + c_lines
    text += ["", "## 2. Kernel speed (forward + backward)", ""]
    text += ([f"![kernel time vs T]({PLOT})", ""] if plotted else []) + k_lines
    text += ["", "## 3. End to end (one training step, FSDP2 on one GPU)", ""] + e_lines
    text += ["", "## 4. verl's trainer (main_ppo, vLLM rollout)", ""]
    text += (v_lines if verl else ["not run"]) + [""]
    (out / SUMMARY).write_text("\n".join(text))
    checks = {"failed": failed, "triton_slower": slower, "below_efficiency": short, "verl": verl_bad}
    return checks | {"plotted": plotted}


def plan(out: Path, header: list[str]) -> list:
    from .runner import Case

    def run() -> dict:
        checks = write(out, header)
        bad = checks["failed"] or checks["triton_slower"] or checks["below_efficiency"] or checks["verl"]
        return checks | {
            "status": "ok",
            "headline": f"{SUMMARY} written" + ("; acceptance not met" if bad else ""),
        }

    return [Case("summary and plot", run)]

"""What do gpu-proof's results say, as markdown? proof.md, rendered from the phases' JSON files (gpu_proof.py)."""

from benchmarks.gpu_systems import SYSTEMS
from support.accounting.memory import fmt


def md_table(headers, rows):
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join("---" for _ in headers) + " |"]
    return lines + ["| " + " | ".join(str(x) for x in row) + " |" for row in rows]


def ratio_text(r):
    return f"{r['median']:.2f}x ({r['low']:.2f}-{r['high']:.2f}, {r['n']} rounds)" if r else "-"


def md_tests(res):
    counts = {}
    for outcome in res["outcomes"].values():
        counts[outcome] = counts.get(outcome, 0) + 1
    lines = [f"pytest: {res['summary'] or 'no summary line (cut off)'}; exit code {res['exit_code']}"]
    lines += [f"- {test}: {outcome}" for test, outcome in res["outcomes"].items() if outcome in ("FAILED", "ERROR")]
    return lines + [", ".join(f"{k} {v}" for k, v in sorted(counts.items()))]


def md_step(res):
    """bench.py gpu's results: a table and the ratios per workload, then the profiles."""
    m = res["machine"]
    versions = ", ".join(f"{k} {m.get(k)}" for k in ("torch", "cuda", "transformers", "peft", "bitsandbytes", "triton"))
    lines = [f"{m['device']}; {versions}; shape {res['shape']}, {res['rows']} x {res['row']} tokens per step"]
    lines += [f"attention {res['attention']}, LoRA dropout {res.get('dropout')}, {res['warmup']} warm-up steps", ""]
    headers = ["system", "step s", "tokens/s", "supervised/s", "MFU", "peak memory", "step-1 loss"]
    for name, work in res["workloads"].items():
        rows = []
        for key, r in work["systems"].items():
            if "summary" not in r:
                rows.append((SYSTEMS[key], r["status"], "", "", "", "", ""))
                continue
            s = r["summary"]
            peak = fmt(s["peak_bytes"]) if "peak_bytes" in s else "-"
            rates = (f"{s['tokens_per_s']:,.0f}", f"{s['supervised_per_s']:,.0f}", f"{s['mfu']:.1%}")
            rows.append((SYSTEMS[key], f"{s['step_s']:.3f}", *rates, peak, f"{s['loss_step1']:.4f}"))
        lines += [f"**{name}**", ""] + md_table(headers, rows) + [""]
        ratios = [(f"{SYSTEMS[p.split('/')[0]]} / {SYSTEMS[p.split('/')[1]]}", ratio_text(r))
                  for p, r in work["ratios"].items()]  # fmt: skip
        lines += md_table(["ratio (median of rounds, range)", name], ratios) + [""] if ratios else []
    for key, p in res.get("profile", {}).items():
        kinds = ", ".join(f"{k} {v:.1%}" for k, v in p["kinds"].items())
        lines += [f"profile of {SYSTEMS[key]}: {p['total_ms']:.1f} ms of kernels; {kinds}", ""]
        rows = [(k["name"][:90].replace("|", "/"), k["calls"], f"{k['ms']:.2f}", f"{k['share']:.1%}")
                for k in p["kernels"][:8]]  # fmt: skip
        lines += md_table(["kernel", "calls", "ms", "share"], rows) + [""]
    return lines


def md_context(res):
    lines = [f"{res['device']}, {fmt(res['budget_bytes'])}; documents of {res['doc']:,} tokens in the row", ""]
    rows = []
    for s in res["settings"]:
        if "skipped" in s:
            rows.append((s["setting"], "", "", "", s["skipped"], "", "", ""))
        for a in s.get("attempts", []):
            peak = fmt(a["peak_bytes"]) if "peak_bytes" in a else "-"
            step = f"{a['step_s']:.1f}" if "step_s" in a else ""
            row = (s["setting"], f"{s['predicted']:,}", s["limited_by"], f"{a['tokens']:,}", a["status"], peak)
            rows.append((*row, fmt(a["estimate_bytes"]), step))
    headers = [
        "setting",
        "--plan predicts",
        "length limited by",
        "tokens tried",
        "result",
        "peak",
        "estimate",
        "step s",
    ]
    return lines + md_table(headers, rows)


def md_ladder(res):
    rows = []
    for i, label in enumerate(res["rungs"]):
        r = res["systems"].get(f"rung{i}", {})
        if "summary" not in r:
            rows.append((label, r.get("status", "-"), "", "", "", ""))
            continue
        s, g = r["summary"], res["gains"].get(f"rung{i}", {})
        peak = fmt(s["peak_bytes"]) if "peak_bytes" in s else "-"
        gain = (ratio_text(g.get("previous")), ratio_text(g.get("baseline"))) if i else ("", "")
        rows.append((label, f"{s['supervised_per_s']:,.0f}", f"{s['mfu']:.1%}", peak, *gain))
    headers = ["rung", "supervised tokens/s", "MFU", "peak memory", "over the rung before", "over the baseline"]
    return [f"shape {res['shape']}, {res['rows']} x {res['row']} tokens per step, {res['precision']}", ""] + md_table(
        headers, rows
    )


RENDER = {"tests": md_tests, "step": md_step, "compiled": md_step, "context": md_context, "ladder": md_ladder}


def render(proof, results):
    """proof.md: the phases' statuses, then each phase's tables from its JSON (results: {phase: its JSON})."""
    lines = [f"# gpu-proof: `{proof['command']}`", "", f"GPU {proof.get('gpu')}; commit {proof.get('commit')}", ""]
    rows = [(p["name"], p["status"], p.get("seconds", ""), p.get("limit_s", "")) for p in proof["phases"]]
    lines += md_table(["phase", "status", "seconds", "limit"], rows) + [""]
    for name, res in results.items():
        lines += [f"## {name}", ""]
        try:
            lines += RENDER[name](res)
        except (KeyError, TypeError, ValueError) as e:  # a phase stopped early may lack a part: say so, go on
            lines += [f"(incomplete results: {type(e).__name__} {e})"]
        lines.append("")
    return "\n".join(lines) + "\n"

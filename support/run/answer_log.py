"""Where does every answer rl.py sampled go? out_dir/answers.jsonl, one line each, beside metrics.jsonl.

A line is {"step", "task_id", "reward", "verdict", "audit", "answer"}: the step that sampled it, its problem, the reward
and the sandbox's verdict, whether support/evaluation/audit.py flags it, and the model's whole text. Lines are appended
after each step; a run that starts, or resumes from a checkpoint, first keeps only the lines of the steps before it (a
line cut short by a killed process is dropped too), rewritten whole.
"""

import json
import os
from pathlib import Path

from support.evaluation import audit
from support.formats.atomic import atomic_write

NAME = "answers.jsonl"


def lines(step, problems, texts, completions, verdicts, rewards) -> list[dict]:
    """A line for each answer of `step`: its problem, whole text, verdict and reward (rl.py's), and the audit's flag on
    its completion (the code the judge ran)."""
    return [
        dict(step=step, task_id=p["task_id"], reward=r, verdict=v, audit=audit.flagged(p["prompt"], c), answer=t)
        for p, t, c, v, r in zip(problems, texts, completions, verdicts, rewards, strict=True)
    ]


def append(out_dir, rows):
    """The step's answers (dicts) at the end of out_dir/answers.jsonl."""
    with open(os.path.join(out_dir, NAME), "a", encoding="utf-8") as f:
        f.write("".join(json.dumps(row) + "\n" for row in rows))


def keep_until(out_dir, step):
    """out_dir/answers.jsonl with only the answers of steps 1..step (none: an empty file)."""
    path = os.path.join(out_dir, NAME)
    lines = Path(path).read_text(encoding="utf-8").splitlines(True) if os.path.exists(path) else []
    kept = "".join(line for line in lines if line.endswith("\n") and sampled_by(line) <= step)
    atomic_write(path, lambda tmp: Path(tmp).write_text(kept, encoding="utf-8"))


def sampled_by(line) -> float:
    """The step of a line, inf when it is not a whole record (it is dropped)."""
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return float("inf")

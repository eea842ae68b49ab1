"""support/run/answer_log.py: out_dir/answers.jsonl, every sampled answer of every step.

What this file proves: a step's answers are appended as one JSON line each; keeping the steps up to a checkpoint drops
the later steps' lines and a last line cut short (as a killed process leaves it), keeps the rest byte for byte, and
starts a fresh run with an empty file.
"""

import json

from support.run import answer_log


def test_lines_after_a_checkpoint_and_a_cut_line_are_dropped(tmp_path):
    for step in (1, 2, 3):
        answer_log.append(
            tmp_path, [dict(step=step, task_id=f"t{i}", reward=float(i % 2), answer="é\n") for i in (0, 1)]
        )
    path = tmp_path / answer_log.NAME
    whole = path.read_text(encoding="utf-8").splitlines(True)
    assert len(whole) == 6 and json.loads(whole[5]) == dict(step=3, task_id="t1", reward=1.0, answer="é\n")
    with open(path, "a", encoding="utf-8") as f:
        f.write('{"step": 4, "task_id": "t0", "rew')  # a write cut short
    answer_log.keep_until(tmp_path, 2)
    assert path.read_text(encoding="utf-8").splitlines(True) == whole[:4]
    answer_log.keep_until(tmp_path, 0)
    assert path.read_text(encoding="utf-8") == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == [answer_log.NAME]  # no temp file left behind

"""support/run/config.py: config files and --key=value flags become a checked train.Config.

A config file and flags load (a flag wins wherever it stands); a typo names the nearest valid key; a wrong type is
refused; "--data path" (a space, not =) is refused before path is read as a config file; a mistake inside a config file
names its line; every config file in configs/ is valid; offloaded checkpoints without checkpointing are refused in
one line; eval_task where the kernel cannot confine the model's code is refused in one line naming what is missing and
eval_task_unconfined, which accepts it. (Range and choice errors through train.py: test_train.py.)
"""

import dataclasses
import os
import re

import pytest

import rl
import train
from support.evaluation import sandbox
from support.run.config import check_config, load_config, train_conflicts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_config_file_overrides_and_typos(tmp_path):
    cfg = load_config(
        train.Config, [os.path.join(ROOT, "configs/tiny.py"), "--lr=3e-4", "--pack=False", "--model=some/dir"]
    )
    assert (cfg.lr, cfg.pack, cfg.model, cfg.context_length) == (3e-4, False, "some/dir", 128)
    with pytest.raises(ValueError, match="--lora_alpah: .*'lora_alpha'"):
        load_config(train.Config, ["--lora_alpah=1"])
    with pytest.raises(ValueError, match="--max_steps: 'max_steps' must be int"):
        load_config(train.Config, ["--max_steps=abc"])
    bad = tmp_path / "bad.py"
    bad.write_text("lora_rank = 8\n")
    with pytest.raises(ValueError, match=rf"{re.escape(str(bad))}: .*'lora_rank'.*'lora_r'"):
        load_config(train.Config, [str(bad)])


def test_overrides_win_wherever_they_stand_and_config_mistakes_name_the_line(tmp_path):
    """A flag before the config file still overrides it; a str field keeps its text; "--data path" (a space, not =)
    is refused before path is read as a config file; a syntax or name error in a config file is one line naming the
    file and line, not a traceback; a byte-order mark is no mistake."""
    tiny = os.path.join(ROOT, "configs/tiny.py")
    assert (
        load_config(train.Config, ["--lr=3e-4", tiny]).lr == load_config(train.Config, [tiny, "--lr=3e-4"]).lr == 3e-4
    )
    assert load_config(train.Config, ["--out_dir=2024", "--template={instruction}{response}"]).out_dir == "2024"
    with pytest.raises(ValueError, match=r"^--data: needs a value, as --data=VALUE$"):
        load_config(train.Config, ["--data", "mine.jsonl"])
    cases = {"lr = 2e-4\nlora_r = 16 *\n": ":2: invalid syntax", "\n\nlr = base_lr * 2\n": ":3: NameError: name "}
    for text, message in cases.items():
        (bad := tmp_path / "bad.py").write_text(text)
        with pytest.raises(ValueError, match=f"^{re.escape(str(bad) + message)}"):
            load_config(train.Config, [str(bad)])
    (bom := tmp_path / "bom.py").write_text("\ufefflr = 2e-4\n", encoding="utf-8")
    assert load_config(train.Config, [str(bom)]).lr == 2e-4


def test_every_config_file_is_valid():
    """Every config passes the checks on the machine it names: one whose header gives the machine (`--plan=2x24GB`
    for llama70b, whose shards go to CPU memory between uses, which a CPU run refuses) is checked as that plan is;
    the others as this machine checks them. configs/grpo_*.py are rl.py's, whose RLConfig holds train.Common's
    settings and GRPO's."""
    for name in sorted(os.listdir(os.path.join(ROOT, "configs"))):
        path = os.path.join(ROOT, "configs", name)
        named = re.findall(r"--plan=(\S+)", open(path).read())
        chapter = rl.RLConfig if name.startswith("grpo") else train.Config
        cfg = load_config(chapter, [path, *(f"--plan={named[0]}" for _ in named[:1])])
        check_config(cfg, train_conflicts(cfg) if chapter is train.Config else ())


def test_offloaded_checkpoints_need_checkpointing():
    """offload_checkpoints moves what checkpointing keeps: without it there is nothing to move, which is said in one
    line; with it the settings pass, and a tile size is a number of tokens or "auto"."""
    with pytest.raises(ValueError) as refused:
        check_config(train.Config(offload_checkpoints=True))
    assert str(refused.value) == (
        "offload_checkpoints: needs activation_checkpointing=True (it offloads the block inputs that checkpointing "
        "keeps)"
    )
    check_config(train.Config(offload_checkpoints=True, activation_checkpointing=True, mlp_tile_tokens=512))
    with pytest.raises(ValueError, match="mlp_tile_tokens: -1 is out of range"):
        check_config(train.Config(mlp_tile_tokens=-1))


def test_eval_task_needs_confinement_or_consent(monkeypatch, tmp_path):
    """Simulated: a kernel without Landlock. eval_task is refused in one line naming what is missing and the setting
    that runs the code under the Python guards alone; with eval_task_unconfined=True the same config passes, and
    without eval_task nothing is asked."""
    problems = tmp_path / "p.jsonl"
    monkeypatch.setattr(sandbox, "confinement", lambda: "Landlock is not in this kernel")
    with pytest.raises(ValueError) as refused:
        check_config(train.Config(eval_task=str(problems)))
    assert str(refused.value) == (
        "eval_task: the kernel cannot confine the model's code (Landlock is not in this kernel); "
        "eval_task_unconfined=True runs it under the Python guards alone"
    )
    check_config(train.Config(eval_task=str(problems), eval_task_unconfined=True))
    check_config(train.Config())


def test_each_chapter_declares_what_it_uses():
    """rl.py's RLConfig and train.py's Config share train.Common's settings and add their own: a train.py-only setting
    given to rl.py is refused in one line saying so; an unknown key is refused naming the nearest valid one."""
    common = {f.name for f in dataclasses.fields(train.Common)}
    own = {f.name for f in dataclasses.fields(rl.RLConfig)} - common
    assert common < {f.name for f in dataclasses.fields(train.Config)}
    assert own == {"group_size", "problems_per_step", "temperature", "top_p", "kl_coef", "loss_norm", "scale_rewards",
                   "updates_per_batch", "clip_eps", "learnable_only", "skip_no_signal", "shuffle_rewards"}  # fmt: skip
    with pytest.raises(ValueError) as e:
        load_config(rl.RLConfig, ["--batch_tokens=64"], elsewhere=(train.Config, "train.py's"))
    assert str(e.value) == "--batch_tokens: batch_tokens is train.py's"
    with pytest.raises(ValueError) as e:
        load_config(rl.RLConfig, ["--group_sise=4"], elsewhere=(train.Config, "train.py's"))
    assert str(e.value) == "--group_sise: unknown config key 'group_sise'; did you mean 'group_size'?"

"""support/formats/hf_config.py: config.json read into a LlamaConfig and written back.

A family that needs more than a switch is refused with what it would need; config.json round trips write only Hugging
Face keys, as each family's transformers config class spells them, and read back into the same config (logits against
transformers for every family are in test_model.py).
"""

import pytest
import transformers
from test_model import tiny_config

from support.formats.hf_config import from_hf, to_hf


def test_unsupported_family_names_what_is_missing():
    """A model_type that is not a Llama with switches fails in one line saying what it would need."""
    d = to_hf(tiny_config()) | {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"]}
    with pytest.raises(ValueError, match="model_type 'mixtral'.*mixture-of-experts"):
        from_hf(d)
    with pytest.raises(
        ValueError, match="model_type 'gpt2' is not supported \\(expected llama, qwen2, qwen3, mistral\\)"
    ):
        from_hf(d | {"model_type": "gpt2"})
    with pytest.raises(ValueError, match="layer_types.*use_sliding_window"):
        from_hf(d | {"model_type": "qwen2", "architectures": None, "layer_types": ["sliding_attention"] * 2})


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_to_hf_writes_only_config_keys(family):
    """config.json carries keys of the family's Hugging Face config and nothing a fork stores on the config object;
    it reads back to the same config, in ours and in transformers."""
    extra = dict(
        qwen2=dict(qkv_bias=True, sliding_window=5, sliding_layers=[1]),
        qwen3=dict(qk_norm=True, qkv_bias=True, o_bias=True),
    )
    extra["mistral"] = dict(sliding_window=6, sliding_layers=[0, 1])
    cfg = tiny_config(model_type=family, rope_scaling=dict(rope_type="linear", factor=2.0), **extra.get(family, {}))
    cfg.my_experiment = "not a config key"
    d = to_hf(cfg)
    assert "my_experiment" not in d and from_hf(d) == cfg
    theirs = transformers.AutoConfig.for_model(**d)
    legacy = {"architectures", "rope_theta", "rope_scaling"}  # transformers 5 folds the RoPE keys into rope_parameters
    assert set(d) - legacy <= set(theirs.to_dict()), set(d) - set(theirs.to_dict())
    assert (theirs.head_dim, theirs.num_key_value_heads, theirs.rope_parameters["factor"]) == (8, 2, 2.0)
    if family != "llama":
        assert getattr(theirs, "layer_types", ["sliding_attention"] * 2) == [
            "sliding_attention" if i in (cfg.sliding_layers or []) else "full_attention" for i in range(2)
        ]

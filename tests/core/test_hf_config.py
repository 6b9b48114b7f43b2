"""Config classes load without transformers' ``auto_docstring`` (model_loader/hf_config.py)."""

import json
import subprocess
import sys

from pagedlm.core.model_loader.hf_config import without_auto_docstrings


def test_decorator_is_a_no_op_inside_and_restored_after() -> None:
    import transformers.utils as utils

    real = utils.auto_docstring
    with without_auto_docstrings():
        decorate = utils.auto_docstring
        assert decorate is not real

        class A:
            """doc"""

        assert decorate(A) is A
        assert decorate(custom_intro="x")(A) is A
    assert utils.auto_docstring is real


def test_same_config_and_no_model_mappings_imported(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "vocab_size": 1000, "rope_theta": 10000.0, "max_position_embeddings": 256}))
    # a fresh interpreter: this one may have imported the config class (and its docstring) already
    code = (
        "import sys, json\n"
        "from pagedlm.core.model_loader.hf_config import load_hf_config\n"
        f"c = load_hf_config({str(tmp_path)!r})\n"
        "auto = 'transformers.models.auto.modeling_auto' in sys.modules\n"
        "print(json.dumps({'cfg': c.to_dict(), 'auto_models': auto}))\n"
    )
    fast = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
                      .stdout.strip().splitlines()[-1])
    from transformers import AutoConfig

    reference = AutoConfig.from_pretrained(str(tmp_path)).to_dict()
    assert fast["cfg"] == json.loads(json.dumps(reference))
    assert not fast["auto_models"]

"""The dequantized SmolLM2-135M-Instruct: config, dtype, manifest, and a real greedy answer."""

import json


from vtoken.assets import smollm2_dir
from vtoken.assets._common import MANIFEST_NAME, dir_is_complete
from vtoken.assets import smollm2 as sm


def test_config_fields(smollm2_path):
    assert smollm2_path == smollm2_dir()
    cfg = json.loads((smollm2_path / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["num_hidden_layers"] == 30
    assert cfg["num_attention_heads"] == 9
    assert cfg["num_key_value_heads"] == 3
    assert cfg["head_dim"] == 64
    assert cfg["hidden_size"] == 576
    assert cfg["vocab_size"] == 49152
    assert cfg["dtype"] == "bfloat16"
    assert "quantization_config" not in cfg


def test_safetensors_are_bf16(smollm2_path):
    from safetensors import safe_open

    with safe_open(str(smollm2_path / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
        assert "model.embed_tokens.weight" in keys and len(keys) == 272
        dtypes = {str(f.get_slice(k).get_dtype()) for k in keys}
    assert dtypes == {"BF16"}


def test_manifest_complete(smollm2_path):
    assert dir_is_complete(smollm2_path, sm.BUILD_VERSION)
    m = json.loads((smollm2_path / MANIFEST_NAME).read_text())
    assert m["source"]["gguf_sha256"] == sm.GGUF_SHA256
    assert m["source"]["wheel_sha256"] == sm.WHEEL_SHA256
    assert {"model.safetensors", "tokenizer.json", "config.json"} <= set(m["files"])


def test_tokenizer_and_chat_template(smollm2_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    assert len(tok) == 49152
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert "<|im_start|>user\nhi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")


def test_greedy_answer_paris(smollm2_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.bfloat16)
    enc = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=16, do_sample=False)
    answer = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer

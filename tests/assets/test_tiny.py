"""Tiny deterministic Llama: config, byte-identical rebuilds, peaked attention, tokenizer."""

import json

import pytest
import torch

from vtoken.assets import tiny
from vtoken.assets._common import MANIFEST_NAME, sha256_file


def test_config(tiny_path):
    cfg = json.loads((tiny_path / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2 and cfg["hidden_size"] == 128
    assert cfg["num_attention_heads"] == 2 and cfg["head_dim"] == 64
    assert cfg["num_key_value_heads"] == 1 and cfg["intermediate_size"] == 256
    assert cfg["vocab_size"] == 512 and cfg["max_position_embeddings"] == 4096
    assert cfg["tie_word_embeddings"] is False and cfg["dtype"] == "float32"
    theta = cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta"))
    assert theta == 10000.0


def test_byte_identical_rebuilds(tiny_path, tmp_path):
    a = tiny.build(tmp_path / "a")
    b = tiny.build(tmp_path / "b")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert sha256_file(a / name) == sha256_file(b / name), name
    # and identical to the shared cache built by another process
    cached = json.loads((tiny_path / MANIFEST_NAME).read_text())["files"]
    assert cached["model.safetensors"] == sha256_file(a / "model.safetensors")


def test_crash_leftovers_are_rebuilt(tmp_path, monkeypatch):
    from vtoken.assets import ensure_tiny_model, tiny_model_dir

    monkeypatch.setenv("VTOKEN_HOME", str(tmp_path))
    d = tiny_model_dir()
    d.mkdir(parents=True)
    stale = d.parent / ".tmp-tiny-llama-crashed"  # temp dir of a build that died
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")
    (d / "model.safetensors").write_bytes(b"half-written")  # no manifest: not complete
    out = ensure_tiny_model()
    assert out == d and (d / MANIFEST_NAME).is_file()
    h = sha256_file(d / "model.safetensors")
    assert h == json.loads((d / MANIFEST_NAME).read_text())["files"]["model.safetensors"]
    mtime = (d / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model() == d  # idempotent: no rebuild
    assert (d / "model.safetensors").stat().st_mtime_ns == mtime
    assert not [p for p in d.parent.iterdir() if p.name.startswith(".tmp-")]


@pytest.fixture(scope="module")
def hf_model(tiny_path):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(tiny_path, attn_implementation="eager")
    return m.eval()


def test_attention_peaked_and_logit_gaps(hf_model):
    ids = torch.randint(0, 256, (1, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = hf_model(ids, output_attentions=True)
    for probs in out.attentions:  # [1, heads, 200, 200]
        assert probs.max(-1).values.mean().item() > 0.3
        # log-prob spread across keys == spread of q.k/sqrt(d) (row shift cancels)
        logit_std = torch.log(probs[0, :, 150:, :150]).std(-1).mean().item()
        assert 2.0 < logit_std < 5.0, logit_std
    logits = out.logits[0]
    assert logits.std(-1).mean().item() >= 3.0
    top2 = logits.topk(2, -1).values
    assert (top2[:, 0] - top2[:, 1]).median().item() > 0.3


def test_tokenizer(tiny_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_path)
    text = "héllo wörld\n\t!"
    ids = tok(text, add_special_tokens=False).input_ids
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.eos_token_id == tiny.EOS_ID and tok.bos_token_id == tiny.BOS_ID
    assert len(tok) <= 512
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == "<|bos|><|user|>hi\n<|assistant|>"


def test_hf_generate_runs(hf_model):
    ids = torch.tensor([[tiny.BOS_ID] + list(b"hello")])
    with torch.no_grad():
        out = hf_model.generate(ids, max_new_tokens=8, do_sample=False)
    assert out.shape == (1, 14)

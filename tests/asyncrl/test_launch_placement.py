"""The launcher plans the placement a --spec job asks for (asyncrl.launch.spec_placement)."""

from __future__ import annotations

import json

import pytest

from asyncrl.launch import spec_placement


def test_the_spec_placement_wins_then_the_node_variable(tmp_path, monkeypatch):
    monkeypatch.delenv("NODE_PLACEMENT", raising=False)
    path = tmp_path / "job.json"
    path.write_text(json.dumps({"model_path": "/m", "placement": "colocated"}))
    assert spec_placement(path) == "colocated"
    path.write_text(json.dumps({"model_path": "/m"}))
    assert spec_placement(path) == "split"
    assert spec_placement(None) == "split"
    monkeypatch.setenv("NODE_PLACEMENT", "colocated")
    assert spec_placement(None) == "colocated"
    path.write_text(json.dumps({"model_path": "/m", "placement": "everywhere"}))
    with pytest.raises(ValueError, match="placement 'everywhere'; valid are split, colocated"):
        spec_placement(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="--spec"):
        spec_placement(path)

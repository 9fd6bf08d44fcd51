"""The texts shipped in llmu/data: present, as documented, and the right size for what uses them."""

from __future__ import annotations

import re

import pytest

from llmu.data import json, json_names, names, text


def test_names():
    assert names() == ["essays", "luke_kjv"]
    with pytest.raises(ValueError, match="no text named"):
        text("hamlet")


def test_json_names_are_the_files_json_reads():
    assert {"spec_acceptance", "sft_examples", "training_runs"} <= set(json_names())
    assert all(json(name) is not None for name in json_names())
    with pytest.raises(ValueError, match="no JSON file named 'hamlet'; available: \\['gqa_perplexity'"):
        json("hamlet")


@pytest.mark.slow
def test_luke_is_a_20k_to_50k_token_public_domain_text(smollm2):
    _, tok = smollm2
    luke = text("luke_kjv")
    assert luke.startswith("Chapter 1\n\nForasmuch as many have taken in hand")
    assert len(re.findall(r"^Chapter \d+$", luke, flags=re.M)) == 24
    assert not re.search(r"\b\d+:\d+\b", luke), "verse references must have been removed"
    n = len(tok.encode(luke))
    assert 20_000 <= n <= 50_000, f"module 10 needs 20k-50k tokens of evaluation text, got {n}"

"""Backbones other than the embedded one: local attention layers, and layers the engine cannot read.

The models are tiny and randomly initialised (built from transformers' own configs, with
the embedded tokenizer), which is all these tests need: whatever the weights, the engine
must compute what the model itself computes on the same tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from langchain_core.decisions import Noul
from transformers import AutoTokenizer

from clef_guard import LocalDecisionModel
from clef_guard.engine.backbone import embedded_model_path
from clef_guard.engine.requests import parse_questions
from clef_guard.errors import ModelLoadError

WINDOW = 16
QUESTIONS = parse_questions({"q": Noul(instructions="Does the agent delete anything?")})
LONG = " ".join(f"row {i}: invoices for region {i % 7} were archived." for i in range(40))


def _save(config: Any, model_class: Any, directory: Path) -> str:
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_path())
    config.vocab_size = len(tokenizer)
    model_class(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def _small(**extra: Any) -> dict[str, Any]:
    return dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=4096,
        **extra,
    )


@pytest.fixture(scope="module")
def gemma_like(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Local and global layers alternating, as in Gemma 2 and 3."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    kinds = ["sliding_attention", "full_attention"] * 2
    config = Gemma3TextConfig(**_small(sliding_window=WINDOW, layer_types=kinds))
    return _save(config, Gemma3ForCausalLM, tmp_path_factory.mktemp("gemma-like"))


@pytest.fixture(scope="module")
def mistral_like(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Every layer local, as in Mistral 7B v0.1."""
    from transformers import MistralConfig, MistralForCausalLM

    return _save(MistralConfig(**_small(sliding_window=WINDOW)), MistralForCausalLM, tmp_path_factory.mktemp("mistral-like"))


def _native(engine: LocalDecisionModel, state: str) -> torch.Tensor:
    """The model's own forward (its own masks, no cache) over the prompt the engine reads: the question's last state."""
    item = engine._prepare(engine._job(state, QUESTIONS))  # the engine's prompt is the oracle's input
    tokens = [*item.prefix, *item.job.branches[0].question_tokens]
    with torch.inference_mode():
        return engine.backbone.decoder(input_ids=torch.tensor([tokens])).last_hidden_state[0, -1]


@pytest.mark.parametrize("model", ["gemma_like", "mistral_like"])
def test_local_layers_read_past_their_window_as_the_model_does(model: str, request: pytest.FixtureRequest) -> None:
    engine = LocalDecisionModel(model=request.getfixturevalue(model), encoder=None)
    assert engine.backbone.sliding_window == WINDOW
    assert engine.backbone.mixed_attention is (model == "gemma_like")
    # Longer and longer states that share a beginning, then one that leaves it: the
    # prefix cache is extended, then cut back, and every answer must still be the model's.
    states = [LONG, LONG + " Then the agent ran rm -rf /srv/invoices.", LONG[:300] + " Nothing else happened."]
    cached = []
    for state in states:
        encoded = engine.encode(state, QUESTIONS)
        torch.testing.assert_close(encoded.features[0].query, _native(engine, state), atol=1e-4, rtol=1e-4)
        cached.append(encoded.cached_tokens)
    assert cached[0] == 0 and cached[1] > 4 * WINDOW and 0 < cached[2] < cached[1]
    (packed,) = engine.encode_for_training(states[1], QUESTIONS)  # one pass, no cache, the tree mask throughout
    torch.testing.assert_close(packed.query, _native(engine, states[1]), atol=1e-4, rtol=1e-4)


def test_a_window_ignored_would_be_caught(gemma_like: str) -> None:
    """The check above can fail: read with global attention everywhere, the answer moves."""
    engine = LocalDecisionModel(model=gemma_like, encoder=None, prefix_cache_size=0)
    engine.backbone.sliding_window = None
    (features,) = engine.encode(LONG, QUESTIONS).features
    assert (features.query - _native(engine, LONG)).abs().max() > 1e-2


def test_a_model_with_recurrent_layers_is_refused_by_name(tmp_path: Path) -> None:
    from transformers import Lfm2Config, Lfm2ForCausalLM

    path = _save(Lfm2Config(**_small(layer_types=["conv", "full_attention"] * 2)), Lfm2ForCausalLM, tmp_path)
    with pytest.raises(ModelLoadError, match=r"conv layers keep a state"):
        LocalDecisionModel(model=path, encoder=None).backbone

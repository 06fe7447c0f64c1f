"""Backbones other than the embedded one: the families people bring, local attention layers
included, and layers the engine cannot read.

The models are tiny and randomly initialised (built from transformers' own configs, with
the embedded tokenizer), which is all these tests need: whatever the weights, the engine
(prefix cache, cut-back prefixes, tree masks) must compute what the model itself computes
on the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as t
from langchain_core.decisions import Noul
from transformers import AutoTokenizer

from clef_guard import LocalDecisionModel
from clef_guard.engine.backbone import embedded_model_path, resolve_dtype
from clef_guard.engine.requests import parse_questions
from clef_guard.errors import ModelLoadError

WINDOW = 16
QUESTIONS = parse_questions({"q": Noul(instructions="Does the agent delete anything?")})
LONG = " ".join(f"row {i}: invoices for region {i % 7} were archived." for i in range(40))


def _save(model: Any, directory: Path) -> str:
    """``model``, its embeddings sized to the embedded tokenizer's vocabulary, saved with that tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_path())
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(directory)
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


LOCAL = dict(sliding_window=WINDOW)
ALTERNATING = ["sliding_attention", "full_attention"] * 2  # Gemma 2 and 3
FAMILIES: dict[str, tuple[Callable[[], Any], tuple[int | None, bool]]] = {
    # a tiny model of each family people bring, randomly initialised, and the
    # (sliding window, local and global layers mixed) the engine must find in it
    "llama": (lambda: t.LlamaForCausalLM(t.LlamaConfig(**_small())), (None, False)),
    "qwen3": (lambda: t.Qwen3ForCausalLM(t.Qwen3Config(**_small())), (None, False)),
    "gpt2": (lambda: t.GPT2LMHeadModel(t.GPT2Config(n_embd=64, n_layer=2, n_head=2, n_positions=4096)), (None, False)),
    "gemma3": (lambda: t.Gemma3ForCausalLM(t.Gemma3TextConfig(**_small(**LOCAL, layer_types=ALTERNATING))), (WINDOW, True)),
    "qwen2-window": (
        lambda: t.Qwen2ForCausalLM(t.Qwen2Config(**_small(**LOCAL, use_sliding_window=True, max_window_layers=2))),
        (WINDOW, True),
    ),
    # Every layer local and no layer types in the config (Mistral 7B v0.1, Phi-3).
    "mistral": (lambda: t.MistralForCausalLM(t.MistralConfig(**_small(**LOCAL))), (WINDOW, False)),
    "phi3": (lambda: t.Phi3ForCausalLM(t.Phi3Config(**_small(**LOCAL, pad_token_id=0))), (WINDOW, False)),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def architecture(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """``(name, path)`` of a saved tiny model."""
    torch.manual_seed(0)
    return request.param, _save(FAMILIES[request.param][0](), tmp_path_factory.mktemp(request.param))


def _native(engine: LocalDecisionModel, state: str, decoder: Any = None) -> torch.Tensor:
    """The model's own forward (its own masks, no cache) over the prompt the engine reads: the question's last state.
    ``decoder``: another model's decoder to run on those tokens."""
    item = engine._prepare(engine._job(state, QUESTIONS))  # the engine's prompt is the oracle's input
    tokens = [*item.prefix, *item.job.branches[0].question_tokens]
    with torch.inference_mode():
        return (decoder or engine.backbone.decoder)(input_ids=torch.tensor([tokens])).last_hidden_state[0, -1]


def test_the_engine_reads_as_the_model_does_past_any_window(architecture: tuple[str, str]) -> None:
    name, path = architecture
    engine = LocalDecisionModel(model=path, encoder=None)
    assert (engine.backbone.sliding_window, engine.backbone.mixed_attention) == FAMILIES[name][1]
    # Longer and longer states that share a beginning, then one that leaves it: the
    # prefix cache is extended, then cut back, and every answer must still be the model's.
    states = [LONG, LONG + " Then the agent ran rm -rf /srv/invoices.", LONG[:300] + " Nothing else happened."]
    cached = []
    for state in states:
        encoded = engine.encode(state, QUESTIONS)
        torch.testing.assert_close(encoded.features[0].query, _native(engine, state), atol=1e-4, rtol=1e-4)
        cached.append(encoded.cached_tokens)
    assert cached[0] == 0 and cached[1] > 10 * WINDOW and 0 < cached[2] < cached[1]
    (packed,) = engine.encode_for_training(states[1], QUESTIONS)  # one pass, no cache, the tree mask throughout
    torch.testing.assert_close(packed.query, _native(engine, states[1]), atol=1e-4, rtol=1e-4)


def test_cut_to_its_first_layers_the_engine_reads_what_that_shallower_model_reads(architecture: tuple[str, str]) -> None:
    """``layers=`` runs the model's first layers (and its final norm) and nothing else, prefix cache included:
    what the same model built with that many layers computes, local layers' windows included."""
    name, path = architecture
    config = t.AutoConfig.from_pretrained(path)
    total = int(config.num_hidden_layers)
    cut = config.num_hidden_layers = total - 1  # Gemma keeps both layer types
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:cut]
    engine = LocalDecisionModel(model=path, encoder=None, layers=cut)
    shallow = t.AutoModelForCausalLM.from_pretrained(path, config=config).eval()
    assert (engine.backbone.layers, engine.backbone.model_layers, engine.backbone.cut_at) == (cut, total, cut)
    assert engine.feature_key != LocalDecisionModel(model=path, encoder=None).feature_key
    for state in (LONG, LONG + " Then the agent ran rm -rf /srv/invoices."):  # the second extends the cached first
        encoded = engine.encode(state, QUESTIONS)
        torch.testing.assert_close(encoded.features[0].query, _native(engine, state, shallow.base_model), atol=1e-4, rtol=1e-4)
    assert encoded.cached_tokens > 10 * WINDOW
    full = _native(LocalDecisionModel(model=path, encoder=None), LONG)  # the check can fail: all layers read otherwise
    assert (engine.encode(LONG, QUESTIONS).features[0].query - full).abs().max() > 1e-2


def test_a_window_ignored_would_be_caught(tmp_path: Path) -> None:
    """The check above can fail: read with global attention everywhere, the answer moves."""
    torch.manual_seed(0)
    engine = LocalDecisionModel(model=_save(FAMILIES["gemma3"][0](), tmp_path), encoder=None, prefix_cache_size=0)
    engine.backbone.sliding_window = None
    (features,) = engine.encode(LONG, QUESTIONS).features
    assert (features.query - _native(engine, LONG)).abs().max() > 1e-2


def test_a_model_with_recurrent_layers_is_refused_by_name(tmp_path: Path) -> None:
    from transformers import Lfm2Config, Lfm2ForCausalLM

    path = _save(Lfm2ForCausalLM(Lfm2Config(**_small(layer_types=["conv", "full_attention"] * 2))), tmp_path)
    with pytest.raises(ModelLoadError, match=r"conv layers keep a state"):
        LocalDecisionModel(model=path, encoder=None).backbone


def test_a_gpu_reads_small_models_in_float32_and_large_ones_in_half_precision(tmp_path: Path) -> None:
    """No weights are needed to choose: the count comes from the config (TinyLlama's 1.1B here)."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    t.LlamaConfig(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4
    ).save_pretrained(tmp_path)
    assert resolve_dtype(None, cuda, str(embedded_model_path())) == torch.float32
    assert resolve_dtype(None, cuda, str(tmp_path)) in (torch.bfloat16, torch.float16)
    assert resolve_dtype(None, cpu, str(tmp_path)) == torch.float32
    assert resolve_dtype("bfloat16", cpu, str(tmp_path)) == torch.bfloat16
    with pytest.raises(ModelLoadError, match="'int8' is not one of"):
        resolve_dtype("int8", cpu, str(tmp_path))

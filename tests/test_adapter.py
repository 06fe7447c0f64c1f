"""A peft LoRA adapter and a decision head load with the backbone and change its answers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from langchain_core.decisions import Noul
from peft import LoraConfig, get_peft_model

from clef_guard import DecisionHead, LocalDecisionModel, ModelLoadError
from clef_guard.engine.backbone import embedded_model_path

REQUEST = {"state": "rm -rf /srv/backups", "questions": {"d": Noul(instructions="Does this delete data?")}}


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory: pytest.TempPathFactory, engine: LocalDecisionModel) -> Path:
    """A real LoRA adapter (random, non-zero B) with a decision head beside it."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("adapter")
    base = AutoModelForCausalLM.from_pretrained(embedded_model_path())
    torch.manual_seed(0)  # the random LoRA and head do not depend on the tests that ran before
    lora = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    lora.save_pretrained(folder)
    head = DecisionHead(engine.backbone.hidden_size)
    torch.nn.init.normal_(head.proj.weight, std=0.05)
    head.save(folder / "decision_head.safetensors")
    return folder


def test_adapter_and_head_change_the_answers(engine: LocalDecisionModel, adapter_dir: Path) -> None:
    tuned = LocalDecisionModel(adapter=str(adapter_dir))
    assert tuned.decision_head is not None
    # Several states, so that one answer landing near the base answer by chance cannot fail it.
    requests = [{**REQUEST, "state": state} for state in ("rm -rf /srv/backups", "ls -la /srv", "Send the report to Dana.")]
    base = [engine.invoke(request).nouls["d"].noul for request in requests]
    tuned_p = [tuned.invoke(request).nouls["d"].noul for request in requests]
    assert max(abs(b - t) for b, t in zip(base, tuned_p)) > 1e-3
    assert all(0.0 <= p <= 1.0 for p in tuned_p)


def test_head_round_trips_through_its_file(engine: LocalDecisionModel, adapter_dir: Path) -> None:
    loaded = DecisionHead.load(adapter_dir / "decision_head.safetensors", engine.backbone.hidden_size)
    hidden = torch.randn(3, engine.backbone.hidden_size)
    logits = loaded(hidden, torch.zeros(3), "noul")
    assert logits.shape == (3,) and logits.abs().sum() > 0


def test_bad_adapter_and_head_paths_fail_clearly(tmp_path: Path, engine: LocalDecisionModel) -> None:
    with pytest.raises(ModelLoadError, match="adapter_config.json"):
        LocalDecisionModel(adapter=str(tmp_path))
    with pytest.raises(ModelLoadError, match="does not exist"):
        LocalDecisionModel(head=str(tmp_path / "missing.safetensors"))
    narrow = tmp_path / "narrow.safetensors"
    DecisionHead(8).save(narrow)
    with pytest.raises(ModelLoadError, match="hidden size is 576"):
        DecisionHead.load(narrow, engine.backbone.hidden_size)


def test_the_shipped_head_loads_by_default_and_changes_answers(engine: LocalDecisionModel) -> None:
    assert engine.decision_head is not None, "LocalDecisionModel() loads clef_guard/heads/default.safetensors"
    zero_shot = LocalDecisionModel(default_head=False)
    assert zero_shot.decision_head is None
    assert abs(engine.invoke(REQUEST).nouls["d"].noul - zero_shot.invoke(REQUEST).nouls["d"].noul) > 1e-3


@pytest.mark.parametrize("version", [1, 5, 6])
def test_a_head_in_an_older_format_is_refused_with_what_to_do(engine: LocalDecisionModel, tmp_path: Path, version: int) -> None:
    from safetensors.torch import save_file

    width = engine.backbone.hidden_size
    tensors = {name: value for name, value in DecisionHead(width).state_dict().items()}
    path = tmp_path / f"v{version}.safetensors"
    save_file(tensors, str(path), metadata={"format": f"clef-guard-head/{version}", "hidden_size": str(width)})
    with pytest.raises(ModelLoadError, match=rf"v{version}.safetensors.*clef-guard-head/{version}.*retrain it"):
        DecisionHead.load(path, width)
    with pytest.raises(ModelLoadError, match="retrain it"):
        LocalDecisionModel(head=str(path))


def test_a_head_saved_untrained_loads_its_missing_parts_as_new(engine: LocalDecisionModel, tmp_path: Path) -> None:
    """An untrained wide map and hidden layer are left out of the file; load recreates them."""
    width = engine.backbone.hidden_size
    torch.manual_seed(3)
    trained = DecisionHead(width)
    with torch.no_grad():
        trained.proj.weight.normal_()
    trained.save(tmp_path / "h.safetensors")
    head = DecisionHead.load(tmp_path / "h.safetensors", width)
    assert not head.training, "a loaded head answers without dropout"
    hidden, logprob, query = torch.randn(20, width), torch.randn(20), torch.randn(width)
    with torch.no_grad():
        assert torch.allclose(head(hidden, logprob, "noul"), trained.eval()(hidden, logprob, "noul"), atol=1e-5)
        assert torch.allclose(head(hidden, logprob, "wide", query), logprob, atol=1e-6)

"""A peft LoRA adapter and a decision head load with the backbone and change its answers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from langchain_core.decisions import Noul
from peft import LoraConfig, get_peft_model

from clef_guard import DecisionHead, LocalDecisionModel, ModelLoadError
from clef_guard._backbone import embedded_model_path

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


def test_a_first_format_head_applies_its_one_set_of_weights_to_every_kind(engine: LocalDecisionModel, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    width = engine.backbone.hidden_size
    torch.manual_seed(1)
    weight = torch.randn(1, width)
    save_file(
        {"proj.weight": weight, "proj.bias": torch.tensor([0.5]), "lm_weight": torch.tensor(2.0),
         "log_temperature": torch.zeros(3)},
        str(tmp_path / "v1.safetensors"),
        metadata={"format": "clef-guard-head/1", "hidden_size": str(width)},
    )
    head = DecisionHead.load(tmp_path / "v1.safetensors", width)
    hidden, logprob = torch.randn(2, width), torch.tensor([-1.0, -2.0])
    expected = hidden @ weight[0] + 0.5 + 2.0 * logprob
    with torch.no_grad():
        for kind in ("noul", "choice", "score"):
            assert torch.allclose(head(hidden, logprob, kind), expected, atol=1e-5)


@pytest.mark.parametrize("version", [2, 3, 4])
def test_heads_before_format_5_read_wide_choices_with_the_backbone(
    engine: LocalDecisionModel, tmp_path: Path, version: int
) -> None:
    """/2 had no wide reading; /3 learned one on wide features the engine no longer computes, /4 a
    bilinear match over standardised vectors that the symmetric map replaced."""
    from safetensors.torch import save_file

    width, readings = engine.backbone.hidden_size, min(version + 1, 4)  # /3 added the wide reading
    torch.manual_seed(2)
    old = {"proj.weight": torch.randn(readings, width), "proj.bias": torch.randn(readings),
           "lm_weight": torch.rand(readings), "log_temperature": torch.zeros(readings)}
    if version >= 3:
        old |= {"query_proj": torch.randn(128, width), "label_proj": torch.randn(128, width)}
    if version == 4:
        old |= {f"{side}_{stat}": torch.rand(width) for side in ("query", "label") for stat in ("center", "scale")}
    path = tmp_path / f"v{version}.safetensors"
    save_file(old, str(path), metadata={"format": f"clef-guard-head/{version}", "hidden_size": str(width)})
    head = DecisionHead.load(path, width)
    hidden, logprob, query = torch.randn(20, width), torch.randn(20), torch.randn(width)
    with torch.no_grad():
        assert torch.allclose(head(hidden, logprob, "choice"), hidden @ old["proj.weight"][1] + old["proj.bias"][1]
                              + old["lm_weight"][1] * logprob, atol=1e-4)
        assert torch.allclose(head(hidden, logprob, "wide", query), logprob)


def test_a_format_5_head_keeps_its_wide_map_and_gains_an_empty_hidden_layer(engine: LocalDecisionModel, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    width = engine.backbone.hidden_size
    torch.manual_seed(3)
    trained = DecisionHead(width)
    with torch.no_grad():
        trained.match_up.normal_()
    old = {name: value for name, value in trained.state_dict().items() if not name.startswith("hidden_")}
    path = tmp_path / "v5.safetensors"
    save_file(old, str(path), metadata={"format": "clef-guard-head/5", "hidden_size": str(width)})
    head = DecisionHead.load(path, width)
    assert not head.training, "a loaded head answers without dropout"
    hidden, logprob, query = torch.randn(20, width), torch.randn(20), torch.randn(width)
    with torch.no_grad():
        assert torch.allclose(head(hidden, logprob, "wide", query), trained.eval()(hidden, logprob, "wide", query), atol=1e-4)
        assert torch.allclose(head(hidden, logprob, "noul"), logprob, atol=1e-6)

"""The decision head: turns per-option features into option logits.

For every option the engine extracts two features: the hidden state of the token that
closes the option (it has read the state, the question and the option) and the
backbone's mean log-probability of the option's tokens. The head scores an option as
``w[kind] . h + b[kind] + lm_weight[kind] * lm_logprob`` and divides by a temperature
per question kind; the softmax over a question's options gives its probabilities. Each
kind (noul, choice, score) has its own weights, so learning choices does not cost yes/no
accuracy, and a kind the head was never trained on reads the backbone alone.

Without a trained head the engine uses the backbone alone (``w = 0``, ``lm_weight = 1``,
temperature 1): the zero-shot language-model reading.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from clef_guard._errors import ModelLoadError

KINDS: tuple[str, ...] = ("noul", "choice", "score")
HEAD_FILE = "decision_head.safetensors"
_FORMAT = "clef-guard-head/2"


class DecisionHead(nn.Module):
    """Linear option scorer over hidden states and LM log-probabilities."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.proj = nn.Linear(hidden_size, len(KINDS))
        self.lm_weight = nn.Parameter(torch.ones(len(KINDS)))
        self.log_temperature = nn.Parameter(torch.zeros(len(KINDS)), requires_grad=False)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, hidden: torch.Tensor, lm_logprob: torch.Tensor, kind: str) -> torch.Tensor:
        """Option logits for one question: ``hidden`` is ``[n, H]``, ``lm_logprob`` ``[n]``."""
        k = KINDS.index(kind)
        raw = hidden.to(self.proj.weight.dtype) @ self.proj.weight[k] + self.proj.bias[k] + self.lm_weight[k] * lm_logprob
        return raw / self.log_temperature[k].exp()

    def save(self, path: str | Path) -> None:
        """Write the head as safetensors with its format and width in the metadata."""
        tensors = {name: value.detach().cpu().contiguous() for name, value in self.state_dict().items()}
        save_file(tensors, str(path), metadata={"format": _FORMAT, "hidden_size": str(self.hidden_size)})

    @classmethod
    def load(cls, path: str | Path, hidden_size: int) -> DecisionHead:
        """Read a head written by :meth:`save`; its width must match the backbone's."""
        try:
            tensors = load_file(str(path))
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot read decision head {str(path)!r}: {exc}") from exc
        width = tensors.get("proj.weight", torch.empty(0, 0)).shape[-1]
        if width != hidden_size:
            raise ModelLoadError(
                f"decision head {str(path)!r} is {width} wide but the backbone's hidden size is "
                f"{hidden_size}: train a head for this backbone"
            )
        if tensors["proj.weight"].shape[0] == 1:  # clef-guard-head/1: one set of weights for every kind
            tensors["proj.weight"] = tensors["proj.weight"].expand(len(KINDS), -1).clone()
            tensors["proj.bias"] = tensors["proj.bias"].expand(len(KINDS)).clone()
            tensors["lm_weight"] = tensors["lm_weight"].reshape(1).expand(len(KINDS)).clone()
        head = cls(hidden_size)
        head.load_state_dict(tensors)
        return head

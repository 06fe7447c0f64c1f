"""The decision head: turns per-option features into option logits.

A question is read in one of four ways (:data:`READINGS`): a ``noul``, a ``score``, a
``choice`` whose options the prompt lists (each option a branch of the forward pass),
and a ``wide`` choice, one with more options than the engine lists (see
``LocalDecisionModel.wide_choice_options``).

For a listed option the engine extracts the hidden state of the token that closes it
(it has read the state, the question and the option) and the backbone's mean
log-probability of the option's tokens. The head scores it as
``w[r] . h + b[r] + lm_weight[r] * lm_logprob`` for reading ``r``.

A wide choice is read like a bi-encoder: ``query`` is the hidden state where the one-word
answer would start (it has read the state and the question, no option), each option
``h`` is the query of the same question asked about the option's label alone, and
``lm_logprob`` is the backbone's own match, a scaled centred cosine of the two (see
``clef_guard._engine``). Both vectors are standardised per dimension with statistics of
the training data, and the head adds a low-rank bilinear match ``(U q) . (V e)`` to the
linear terms. A many-way choice then costs one question plus cached option vectors.

Every reading has its own weights and a temperature, so learning choices does not cost
yes/no accuracy, and a reading the head was never trained on reads the backbone alone
(``w = 0``, ``U = 0``, ``lm_weight = 1``, temperature 1), as an engine without a head does.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from clef_guard._errors import ModelLoadError

READINGS: tuple[str, ...] = ("noul", "choice", "score", "wide")
HEAD_FILE = "decision_head.safetensors"
MATCH_RANK = 128
"""Rank of the wide-choice bilinear match."""
_FORMAT = "clef-guard-head/4"
"""Version 4 changed the wide features: older heads' wide reading is dropped on load."""
_PER_READING = ("proj.weight", "proj.bias", "lm_weight", "log_temperature")
_MATCH = ("query_proj", "label_proj", "query_center", "query_scale", "label_center", "label_scale")


class DecisionHead(nn.Module):
    """Linear option scorer over hidden states and LM log-probabilities, per reading."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.proj = nn.Linear(hidden_size, len(READINGS))
        self.lm_weight = nn.Parameter(torch.ones(len(READINGS)))
        self.log_temperature = nn.Parameter(torch.zeros(len(READINGS)), requires_grad=False)
        self.query_proj = nn.Parameter(torch.zeros(MATCH_RANK, hidden_size))
        self.label_proj = nn.Parameter(torch.randn(MATCH_RANK, hidden_size) / hidden_size)
        for side in ("query", "label"):
            self.register_buffer(f"{side}_center", torch.zeros(hidden_size))
            self.register_buffer(f"{side}_scale", torch.ones(hidden_size))
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(
        self, hidden: torch.Tensor, lm_logprob: torch.Tensor, reading: str, query: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Option logits for one question: ``hidden`` is ``[n, H]``, ``lm_logprob`` ``[n]``.

        ``query`` (``[H]``) is required for the ``wide`` reading and ignored otherwise.
        """
        k = READINGS.index(reading)
        hidden = hidden.to(self.proj.weight.dtype)
        match = 0.0
        if reading == "wide":
            if query is None:
                raise ValueError("a wide choice is scored against the question's query vector")
            hidden = (hidden - self.label_center) / self.label_scale
            q = (query.to(hidden.dtype) - self.query_center) / self.query_scale
            match = (hidden @ self.label_proj.T) @ (self.query_proj @ q)
        raw = hidden @ self.proj.weight[k] + self.proj.bias[k] + self.lm_weight[k] * lm_logprob + match
        return raw / self.log_temperature[k].exp()

    def fit_match_scaling(self, queries: torch.Tensor, labels: torch.Tensor) -> None:
        """Set the wide match's standardisation from training ``queries`` and option vectors."""
        for side, rows in (("query", queries), ("label", labels)):
            getattr(self, f"{side}_center").copy_(rows.mean(0))
            # unit variance per dimension, and about unit norm per vector: Adam's steps stay small
            getattr(self, f"{side}_scale").copy_((rows.std(0) + 1e-3) * self.hidden_size**0.5)

    def save(self, path: str | Path) -> None:
        """Write the head as safetensors with its format and width in the metadata."""
        tensors = {name: value.detach().cpu().contiguous() for name, value in self.state_dict().items()}
        save_file(tensors, str(path), metadata={"format": _FORMAT, "hidden_size": str(self.hidden_size)})

    @classmethod
    def load(cls, path: str | Path, hidden_size: int) -> DecisionHead:
        """Read a head written by :meth:`save` (or an older format); its width must match the backbone's."""
        try:
            tensors = load_file(str(path))
            with safe_open(str(path), "pt") as handle:
                file_format = (handle.metadata() or {}).get("format")
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot read decision head {str(path)!r}: {exc}") from exc
        width = tensors.get("proj.weight", torch.empty(0, 0)).shape[-1]
        if width != hidden_size:
            raise ModelLoadError(
                f"decision head {str(path)!r} is {width} wide but the backbone's hidden size is "
                f"{hidden_size}: train a head for this backbone"
            )
        head = cls(hidden_size)
        fresh = head.state_dict()
        for name in _PER_READING:
            stored = tensors.get(name, fresh[name][:0]).reshape(-1, *fresh[name].shape[1:])
            if stored.shape[0] == 1:  # clef-guard-head/1: one set of weights for every kind
                stored = stored.expand(len(READINGS) - 1, *stored.shape[1:])
            # older formats lack trailing readings: those keep the backbone's reading
            tensors[name] = torch.cat([stored, fresh[name][stored.shape[0] :]])
        current = file_format == _FORMAT
        for name in _MATCH:
            if not current or name not in tensors:
                tensors[name] = fresh[name]
        if not current:  # its wide reading learned features the engine no longer computes
            wide = READINGS.index("wide")
            for name in _PER_READING:
                tensors[name][wide] = fresh[name][wide]
        head.load_state_dict(tensors)
        return head

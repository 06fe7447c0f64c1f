"""Wide choices: option vectors, each option read as a request of its own, kept in an LRU cache.

A choice with many options lists none of them. Its query is the penultimate layer's hidden
state where the one-word answer would start; each option is embedded the same way, as
the query of the same question asked about the option's label and description alone.
So query and options come from one encoder and compare before any training.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from clef_guard.engine.backbone import Backbone
from clef_guard.engine.batching import packed
from clef_guard.engine.prompt import label_text
from clef_guard.engine.tree import Branch

_CACHE_SIZE = 4096


class OptionVectors:
    """``[n_options, hidden]`` vectors of a wide choice's options, cached by question and option.

    They depend on the question alone, so they are computed once (and kept out of autograd:
    LoRA training reaches a wide choice through its query alone).
    """

    def __init__(self, size: int = _CACHE_SIZE) -> None:
        self._size = size
        self._cache: OrderedDict[tuple[tuple[int, ...], str], torch.Tensor] = OrderedDict()

    def clear(self) -> None:
        """Forget every vector (the backbone changed)."""
        self._cache.clear()

    def read(self, branch: Branch, prompt: Callable[[str], list[int]], backbone: Backbone, budget: int) -> torch.Tensor:
        """The vectors of ``branch``'s options; ``prompt(text)`` gives the tokens of a request whose state is ``text``."""
        question = branch.question
        asked = tuple(branch.question_tokens)
        keys = [(asked, label_text(label, text)) for label, text in zip(question.options, question.descriptions, strict=True)]
        missing = [key for key in dict.fromkeys(keys) if key not in self._cache]
        prompts = [prompt(text) for _, text in missing]
        with torch.no_grad():
            done = 0
            for group in packed(prompts, len, budget):  # right-padded batches
                width = max(len(ids) for ids in group)
                ids = torch.tensor([ids + [0] * (width - len(ids)) for ids in group], device=backbone.device)
                mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids in group], device=backbone.device)
                states = backbone.decoder(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-2]
                for row, tokens in enumerate(group):
                    self._cache[missing[done]] = states[row, len(tokens) - 1].float().cpu().clone()
                    done += 1
        for key in keys:
            self._cache.move_to_end(key)
        while len(self._cache) > max(self._size, len(keys)):
            self._cache.popitem(last=False)
        return torch.stack([self._cache[key] for key in keys])

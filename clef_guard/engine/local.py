"""``LocalDecisionModel``: an in-process, one-pass decision engine for any causal LM.

How one request is answered (see :mod:`clef_guard.engine.prompt` for the layout):

1. the state is serialised into segments and tokenized after a fixed header; a state
   longer than the context window keeps its beginning and its most recent tokens;
2. the prefix is prefilled once, reusing the longest cached prefix from earlier calls;
3. every question and every option of every question go through *one* more forward
   pass, as branches of a tree (:mod:`clef_guard.engine.tree`): a 4-D attention mask lets each branch see the prefix and
   itself only, so questions never see each other and nothing is generated;
4. each option gets the backbone's mean log-probability of its tokens and the hidden
   state of its closing token; the decision head (or the backbone alone) turns these
   into logits, and a softmax per question into probabilities.

A *wide* choice (more options than ``wide_choice_options``) lists no option and has no
option branches. Its prompt asks for the answer in one word, and the penultimate layer's
hidden state where that word would start is the *query*. Each option is embedded the same
way, as the query of a request whose state is the option's label (and description), once
per question, cached. The backbone's own score for an option is the cosine between the
query and the option, both centred on the mean of the question's options; a head can add
a trained match. So a 255-way choice costs about what a yes/no question does, and labels
no head was trained on are still matched (see :data:`~clef_guard.engine.head.WIDE_MATCH_SCALE`).
"""

from __future__ import annotations

import copy
import hashlib
import json
import threading
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from langchain_core.decisions import (
    BaseDecisionModel,
    ClassifierResponse,
    Question,
    State,
)
from pydantic import ConfigDict, Field, PrivateAttr

from clef_guard.engine.answers import build_answer
from clef_guard.engine.backbone import EMBEDDED_MODEL, Backbone, load_backbone
from clef_guard.engine.batching import EncodedRequest, Job, Prepared, packed
from clef_guard.engine.encoder import EMBEDDED_ENCODER, Encoder, asked_topic, load_encoder
from clef_guard.engine.head import (
    HEAD_FILE,
    WIDE_MATCH_SCALE,
    DecisionHead,
    centred_cosine,
)
from clef_guard.engine.novelty import QuestionMemory, familiarity_scale
from clef_guard.engine.prefix_cache import PrefixCache
from clef_guard.engine.prompt import PromptLayout
from clef_guard.engine.requests import ParsedQuestion, parse_questions
from clef_guard.engine.state import head_and_tail, is_request, state_segments
from clef_guard.engine.tree import (
    Branch,
    Hidden,
    OptionFeatures,
    Tree,
    build_tree,
    target_logprobs,
    with_prefix_rows,
)
from clef_guard.engine.wide import OptionVectors
from clef_guard.errors import ModelLoadError, RequestError

_OMITTED = "[... earlier turns omitted ...]\n"
_CHARS_PER_TOKEN = 16
"""More characters than a tokenizer packs into one token of ordinary text: a state longer than
this many times its token budget loses its middle before it is tokenized, so a huge state
costs what one that fills the window does (the tokens kept are the same)."""
DEFAULT_HEAD = Path(__file__).parents[1] / "heads" / "default.safetensors"
"""The shipped decision head for the embedded backbone."""
WIDE_CHOICE_OPTIONS = 16
"""Beyond this many options a choice is read wide (unless ``wide_choice_options`` says otherwise)."""
ENCODER_WHEN_SURE = 0.8
"""Default of ``encoder_when_sure``, chosen on dev rows of the unseen families: at 0.8 the encoder
answers 84% / 67% of CLINC150 / HWU64 requests asked among 8 / 5 listed intents (99% / 92% of them
right), and 9% / 4% of ASSEBench risk-type and tool-use rows (a third right, as the head)."""
TRAINED_COSINE = 0.99
"""A question this close to one the head was trained on (its familiarity) counts as trained on:
the head keeps answering it, whatever the encoder says (the same words, options reordered)."""


class LocalClassifierResponse(ClassifierResponse):
    """A ``ClassifierResponse`` with what the local engine did to the state."""

    truncated_tokens: int = 0
    """State tokens cut to fit the context window (beginning and latest turns are kept)."""

    cached_tokens: int = 0
    """Prefix tokens served from the prefix cache instead of being recomputed."""

    familiarity: dict[str, float] = {}
    """For each question the head answered: the cosine between it and the nearest question the
    head was trained on (1: trained on verbatim). The further below 1, the more its answer was
    moved towards "every option equally likely" (:mod:`clef_guard.engine.novelty`)."""


class LocalDecisionModel(BaseDecisionModel):
    """A ``BaseDecisionModel`` that runs a Hugging Face causal LM in this process.

    ``LocalDecisionModel()`` loads the embedded default (SmolLM2-135M-Instruct). Pass
    ``model=`` a hub id or a local path for any other causal LM, ``adapter=`` a peft
    LoRA folder, and ``head=`` a decision head file (by default the adapter's
    ``decision_head.safetensors`` when it has one).

    Examples
    --------
    >>> from langchain_core.decisions import Noul
    >>> engine = LocalDecisionModel()
    >>> response = engine.invoke({
    ...     "state": "rm -rf /var/lib/postgres",
    ...     "questions": {"destructive": Noul(instructions="Does this delete data?")},
    ... })
    >>> 0.0 <= response.nouls["destructive"].noul <= 1.0
    True
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    model: str = EMBEDDED_MODEL
    """The embedded default's name, a Hugging Face hub id, or a local model folder."""
    adapter: str | None = None
    """A peft (LoRA) adapter folder to apply to the backbone."""
    head: str | None = None
    """A decision head file; defaults to the adapter's ``decision_head.safetensors``."""
    default_head: bool = True
    """With the embedded backbone and no head or adapter given, load the shipped head
    (trained by ``make default-head``); ``False`` reads the backbone alone (zero-shot)."""
    device: str = "auto"
    """``"auto"`` (CUDA when present), ``"cpu"``, ``"cuda:0"``, ..."""
    dtype: str | None = None
    """``"float32"``, ``"bfloat16"`` or ``"float16"``; default float32, except bfloat16 on CUDA for
    models of a billion parameters or more (:data:`clef_guard.engine.backbone.LOW_PRECISION_FROM`)."""
    layers: int | None = Field(default=None, ge=1)
    """Run only the backbone's first ``layers`` decoder layers and read their output: a pass then
    costs that fraction of the whole model's. By default the depth the head was trained at
    (``clef-guard train --layers``; the shipped head reads all of SmolLM2's 30), else all
    layers; a head trained at another depth is refused."""
    max_state_tokens: int | None = Field(default=None, ge=64)
    """Cap on state tokens; the backbone's context window (less the questions) otherwise."""
    prefix_cache_size: int = Field(default=8, ge=0)
    """How many state prefixes keep their KV cache (0 turns the cache off)."""
    max_tree_tokens: int = Field(default=4096, ge=64)
    """Most question and option tokens scored in one forward pass (more take several), and
    most tokens of concurrent requests packed into one pass."""
    pack_requests: bool | None = None
    """Answer concurrent requests in shared packed passes; by default on a GPU only. A CPU pass
    costs what its tokens do, so packing saves nothing there, while one request at a time lets
    the prefix cache serve what requests share (policies' views of one call share the conversation)."""
    wide_choice_options: int = Field(default=WIDE_CHOICE_OPTIONS, ge=2)
    """A choice with more options than this is read wide: the prompt does not list them,
    and each option's embedding is matched against the question (one pass however many).
    Set it to 255 to list every choice."""
    encoder: str | None = "auto"
    """What reads wide choices and choices whose options carry examples: a sentence encoder (:mod:`clef_guard.engine.encoder`) matching
    the user's request to each option's words, or ``None`` for the backbone (and head). A head
    whose wide map was trained keeps reading wide choices.
    ``"auto"``: the embedded all-MiniLM-L6-v2 when its distribution is installed; or the
    embedded encoder's name, or a local folder of a sentence-transformers model. On label sets
    the head never saw it reads about twice as well as the backbone (docs/results.md)."""
    encoder_when_sure: float | None = Field(default=ENCODER_WHEN_SURE, gt=0.0, le=1.0)
    """A listed choice the head was not trained on (no head, or familiarity below :data:`TRAINED_COSINE`),
    asked about the user's request (the state ends with the user's turn or is plain text: never
    a proposed call or a tool result), is answered by the encoder when the encoder gives its best
    option at least this probability; by the backbone and head otherwise. A yes/no question that
    asks what the request is about ("Is the user asking to ...?": :func:`~clef_guard.engine.encoder.asked_topic`),
    under the same conditions, is the encoder's whatever its odds. ``None``: neither."""

    _backbone: Backbone = PrivateAttr()
    _layout: PromptLayout = PrivateAttr()
    _head: DecisionHead | None = PrivateAttr(default=None)
    _prefix_cache: PrefixCache = PrivateAttr()
    _lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)
    _queue_lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)
    _waiting: list[Job] = PrivateAttr(default_factory=list)
    _option_cache: OptionVectors = PrivateAttr(default_factory=OptionVectors)
    _encoder: Encoder | None = PrivateAttr(default=None)
    _encoder_lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)
    _memories: weakref.WeakKeyDictionary[DecisionHead, QuestionMemory] = PrivateAttr(default_factory=weakref.WeakKeyDictionary)

    def model_post_init(self, context: Any, /) -> None:
        """Load the backbone, adapter and head once, when the engine is built."""
        self._backbone = load_backbone(self.model, adapter=self.adapter, device=self.device, dtype=self.dtype)
        self._layout = PromptLayout.for_tokenizer(self._backbone.tokenizer)
        head_path = self.head or (str(Path(self.adapter) / HEAD_FILE) if self.adapter else None)
        if head_path is None and self.default_head and self.model == EMBEDDED_MODEL:
            head_path = str(DEFAULT_HEAD)
        if head_path and Path(head_path).exists():
            self._head = DecisionHead.load(head_path, self._backbone.hidden_size).to(self._backbone.device).eval()
        elif self.head:
            raise ModelLoadError(f"decision head {self.head!r} does not exist")
        total = self._backbone.layers
        trained_at = (self._head.layers or total) if self._head is not None else None
        layers = self.layers or trained_at or total
        if trained_at is not None and layers != trained_at:
            raise ModelLoadError(
                f"decision head {head_path!r} reads the first {trained_at} of the backbone's {total} decoder layers, "
                f"not {layers}: leave `layers` out or train a head at that depth"
            )
        if layers != total:
            self._backbone.keep_layers(layers)
        self._prefix_cache = PrefixCache(self.prefix_cache_size)

    @property
    def _provider(self) -> str:
        return "clef_guard"

    @property
    def backbone(self) -> Backbone:
        """The loaded backbone (model, tokenizer, device), for training and benchmarks."""
        return self._backbone

    @property
    def decision_head(self) -> DecisionHead | None:
        """The trained decision head, or ``None`` when the backbone answers alone."""
        return self._head

    def clear_prefix_cache(self) -> None:
        """Drop every cached state prefix and wide-choice option vector."""
        with self._lock:
            self._prefix_cache.clear()
            self._option_cache.clear()

    def prefill(self, state: State) -> int:
        """Read ``state`` into the prefix cache, so that a request whose state begins as it
        does reads only the rest; returns the tokens computed (0 when all were cached).

        An agent calls it (through :meth:`clef_guard.Guard.read_ahead`) when tool results
        arrive, while its model writes the next step.
        """
        if self.prefix_cache_size == 0:
            return 0
        prefix, _ = self._prefix_tokens(state, 0)
        with self._lock, torch.inference_mode():
            kv, cached = self._reuse(prefix)
            self._extend(kv, prefix, cached)
        return len(prefix) - cached

    @property
    def feature_key(self) -> str:
        """Names what this engine's features are read by (backbone, adapter, layout, numerics): features
        under one key train heads for every engine with that key."""
        adapter = None
        if self.adapter is not None:  # by content: retraining into the same folder must not reuse features
            weights = Path(self.adapter) / "adapter_model.safetensors"
            adapter = hashlib.sha256(weights.read_bytes()).hexdigest() if weights.exists() else self.adapter
        identity: dict[str, Any] = {"model": self.model, "adapter": adapter, "layout": 2}
        if self._backbone.cut_at is not None:  # the whole model's features keep the key they had
            identity["layers"] = self._backbone.cut_at
        if self._backbone.numerics != "float32":  # float32 features keep the key they had before other numerics
            identity["numerics"] = self._backbone.numerics
        return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]

    def feature_record(self, state: State, questions: Mapping[str, Question]) -> dict[str, Any]:
        """What the backbone reads of ``state`` for each of ``questions``, as JSON a head trains on without the
        state (``{"backbone": feature_key, "questions": {id: OptionFeatures.to_record()}}``).

        The review log writes it; a state the engine just read costs only the questions' branches.
        """
        encoded = self.encode(state, parse_questions(dict(questions)))
        return {"backbone": self.feature_key, "questions": {f.question.id: f.to_record() for f in encoded.features}}

    def reading(self, question: ParsedQuestion) -> str:
        """How ``question`` is read: its kind, or ``"wide"`` for a choice with many options."""
        wide = question.kind == "choice" and len(question.options) > self.wide_choice_options
        return "wide" if wide else question.kind

    def reads_with_encoder(self, question: ParsedQuestion, *, head: DecisionHead | None = None) -> bool:
        """Whether the sentence encoder answers ``question``, when there is an encoder: a choice whose
        options carry examples (a topical choice), or a wide choice unless the head's wide map was
        trained (whoever trained it meant it to read them). ``head``: another head than the engine's."""
        head = head if head is not None else self._head
        wide = self.reading(question) == "wide" and not (head is not None and head.reads_wide)
        topical = wide or (question.kind == "choice" and bool(question.examples))
        return topical and self.sentence_encoder is not None

    @property
    def sentence_encoder(self) -> Encoder | None:
        """The encoder that reads wide choices, loaded on first use; ``None`` when there is none."""
        if self.encoder is None:
            return None
        with self._encoder_lock:
            if self._encoder is None:
                self._encoder = load_encoder(self.encoder, device=self._backbone.device)
            return self._encoder

    def familiarity(self, question: ParsedQuestion, *, head: DecisionHead | None = None) -> float | None:
        """The cosine between ``question`` and the nearest question the head was trained on; ``None``
        when there is no head, it does not list its questions (older heads), the encoder reads the
        question, or there is no encoder. ``head``: another head than the engine's (benchmarks
        score several over one backbone)."""
        head = head if head is not None else self._head
        if head is None or self.reads_with_encoder(question, head=head):
            return None
        if head.readout(question.key) is not None:  # learned from answers to this very question
            return 1.0
        if not head.questions:
            return None
        encoder = self.sentence_encoder
        if encoder is None:
            return None
        with self._encoder_lock:
            memory = self._memories.get(head)
            if memory is None:
                name = EMBEDDED_ENCODER if self.encoder == "auto" else str(self.encoder)
                memory = self._memories[head] = QuestionMemory(head.questions, encoder, name)
        return memory.cosine(question)

    def encoder_reading(self, state: State, question: ParsedQuestion, *, head: DecisionHead | None = None) -> list[float] | None:
        """The encoder's probabilities for a question it answers in the head's place, or ``None``
        where the backbone and head answer: a listed choice when the encoder is sure
        (``encoder_when_sure``), a yes/no question asking what the request is about
        (:func:`~clef_guard.engine.encoder.asked_topic`) whatever its odds; either only when the
        head was not trained on it and the state ends with the user's turn. ``head``: another
        head than the engine's (benchmarks score several over one backbone)."""
        topic = asked_topic(question)
        if self.encoder_when_sure is None or (question.kind != "choice" and topic is None) or self.reads_with_encoder(question, head=head):
            return None
        if not is_request(state):
            return None
        head = head if head is not None else self._head
        if head is not None:
            cosine = self.familiarity(question, head=head)
            if cosine is None or cosine >= TRAINED_COSINE:
                return None
        encoder = self.sentence_encoder
        if encoder is None:
            return None
        probabilities = encoder.probabilities(state, question)
        return probabilities if topic is not None or max(probabilities) >= self.encoder_when_sure else None

    def _classify(self, state: State, questions: dict[str, Question]) -> ClassifierResponse:
        parsed = parse_questions(questions)
        by_encoder = {q.id for q in parsed if self.reads_with_encoder(q)}
        answers, familiarity = {}, {}
        for question in parsed:  # None for the questions the encoder reads anyway (by_encoder)
            if (read := self.encoder_reading(state, question)) is not None:
                answers[question.id] = build_answer(question, read)
        read = [q for q in parsed if q.id not in by_encoder and q.id not in answers]
        encoded = self.encode(state, read) if read else EncodedRequest([], 0, 0, 0)
        with torch.inference_mode():
            for features in encoded.features:
                logits = self.option_logits(features)
                cosine = self.familiarity(features.question)
                if cosine is not None:
                    familiarity[features.question.id] = cosine
                    logits = logits * familiarity_scale(cosine)
                probabilities = torch.softmax(logits.double(), dim=-1).tolist()
                answers[features.question.id] = build_answer(features.question, probabilities)
        encoder = self.sentence_encoder if by_encoder else None
        for question in parsed:
            if encoder is not None and question.id in by_encoder:
                answers[question.id] = build_answer(question, encoder.probabilities(state, question))
        return LocalClassifierResponse(
            model=self.model,
            answers={q.id: answers[q.id] for q in parsed},
            usage={
                "input_tokens": encoded.input_tokens,
                "output_tokens": 0,
                "input_token_details": {"cache_read": encoded.cached_tokens},
            },
            truncated_tokens=encoded.truncated_tokens,
            cached_tokens=encoded.cached_tokens,
            familiarity=familiarity,
        )

    def option_logits(self, features: OptionFeatures) -> torch.Tensor:
        """Option logits for one question: the head's, or the backbone's log-probabilities."""
        if self._head is None:
            return features.lm_logprob.float()
        question = features.question.key if self._head.question_temperatures or self._head.readouts else None  # hashed only when it can matter
        return self._head(features.hidden, features.lm_logprob.float(), features.reading, features.query, question)

    def encode(self, state: State, questions: Sequence[ParsedQuestion]) -> EncodedRequest:
        """Run the backbone once over ``state`` and every option of ``questions``.

        Requests from concurrent threads (``batch``, a server) are combined: whoever
        holds the backbone next runs every waiting request in packed forward passes.
        """
        job = self._job(state, questions)
        with self._queue_lock:
            self._waiting.append(job)
        with self._lock, torch.inference_mode():
            if not job.done:
                with self._queue_lock:
                    jobs, self._waiting = self._waiting, []
                self._run_jobs(jobs)
        if job.error is not None:
            raise job.error
        assert job.result is not None
        return job.result

    def _run_jobs(self, jobs: list[Job]) -> None:
        """Answer ``jobs``: a request alone uses the prefix cache; packed, several share passes (``pack_requests``)."""
        prepared: list[Prepared] = []
        for job in jobs:
            try:
                prepared.append(self._prepare(job))
            except Exception as exc:  # this request's own fault; the others still run
                job.fail(exc)
        pack = self._backbone.device.type != "cpu" if self.pack_requests is None else self.pack_requests
        groups = packed(prepared, lambda item: item.length, self.max_tree_tokens) if pack else [[item] for item in prepared]
        for group in groups:
            try:
                if len(group) == 1:
                    group[0].job.result = self._encode_one(group[0])
                    group[0].job.done = True
                else:
                    self._encode_packed(group)
            except Exception as exc:
                for item in group:
                    item.job.fail(exc)

    def _encode_one(self, item: Prepared) -> EncodedRequest:
        """One request on top of the cached KV of its prefix. What no cached prefix holds is
        read in the same pass as the first branches when it fits: a pass costs tens of
        milliseconds before its first token on a CPU (the weights stream from memory)."""
        prefix = item.prefix
        groups = packed(item.job.branches, lambda branch: branch.length, self.max_tree_tokens)
        try:
            kv, cached = self._reuse(prefix)
            tail = prefix[cached:]
            if not tail or len(tail) + sum(branch.length for branch in groups[0]) > self.max_tree_tokens:
                self._extend(kv, prefix, cached)  # reads a long tail alone; caches the prefix
                tail = ()
            features: list[OptionFeatures] = []
            for group in groups:
                features.extend(self._score_branches(kv, prefix, group, tail))
                tail = ()
        except Exception:
            self._prefix_cache.discard(prefix)
            raise
        return EncodedRequest(features, item.length, cached, item.truncated)

    def encode_for_training(self, state: State, questions: Sequence[ParsedQuestion]) -> list[OptionFeatures]:
        """Features of one request from a plain forward pass that gradients can flow through.

        Unlike :meth:`encode` it skips the prefix cache and inference mode, so a loss on
        the features reaches a LoRA adapter on the backbone. Call it under
        ``torch.enable_grad()`` with the adapter's parameters trainable.
        """
        (features,) = self._forward_packed([self._prepare(self._job(state, questions))])
        return features

    def _job(self, state: State, questions: Sequence[ParsedQuestion]) -> Job:
        return Job(state, [self._branch(question) for question in questions])

    def _prepare(self, job: Job) -> Prepared:
        """``job`` with its prefix tokens, cut to leave room for its longest branch."""
        return Prepared(job, *self._prefix_tokens(job.state, max(b.length for b in job.branches)))

    def _encode_packed(self, group: list[Prepared]) -> None:
        """Several requests in one forward pass, each answered from its own block."""
        for item, features in zip(group, self._forward_packed(group), strict=True):
            item.job.result = EncodedRequest(features, item.length, 0, item.truncated)
            item.job.done = True

    def _forward_packed(self, group: list[Prepared]) -> list[list[OptionFeatures]]:
        """One forward pass over requests laid out as blocks (prefix, then tree), without a cache."""
        device = self._backbone.device
        trees = [build_tree(len(item.prefix), item.job.branches, device) for item in group]
        total = sum(item.length for item in group)
        allowed = torch.zeros(total, total, dtype=torch.bool, device=device)
        tokens: list[int] = []
        positions: list[int] = []
        offsets = []
        for item, tree in zip(group, trees, strict=True):
            start, prefix = len(tokens), len(item.prefix)
            allowed[start : start + item.length, start : start + item.length] = with_prefix_rows(tree, 0)
            tokens += [*item.prefix, *tree.tokens]
            positions += [*range(prefix), *tree.positions]
            offsets.append(start + prefix)
        wide = any(branch.wide for item in group for branch in item.job.branches)
        mask = self._backbone.attention_mask(allowed, positions, positions)
        hidden = self._run(tokens, None, positions=positions, mask=mask, wide=wide)
        return [
            self._features(hidden.rows(offset, len(tree.tokens)), item.job.branches, tree)
            for item, tree, offset in zip(group, trees, offsets, strict=True)
        ]

    def _branch(self, question: ParsedQuestion) -> Branch:
        reading = self.reading(question)
        return Branch(
            question,
            reading,
            self._layout.question_tokens(question, listed=reading != "wide"),
            [self._layout.option_tokens(label) for label in question.options],
        )

    def _prefix_tokens(self, state: State, longest_branch: int) -> tuple[tuple[int, ...], int]:
        """Header and state tokens, cut to fit the context window; and how many were cut."""
        header = list(self._layout.header)
        window = self._backbone.context_window - longest_branch
        budget = min(window, len(header) + self.max_state_tokens) if self.max_state_tokens else window
        segments = head_and_tail(state_segments(state), _CHARS_PER_TOKEN * budget, _OMITTED)
        body = [token for segment in segments for token in self._layout.state_tokens(segment)]
        if len(header) + len(body) <= budget:
            return tuple(header + body), 0
        marker = self._layout.state_tokens(_OMITTED)
        keep = budget - len(header) - len(marker)
        if keep < 16:
            raise RequestError(
                f"the questions take {longest_branch} of the backbone's {self._backbone.context_window} "
                "tokens and leave no room for the state; shorten the instructions or options",
                field="questions",
            )
        head_keep = keep // 4
        tail = body[len(body) - (keep - head_keep) :]
        return tuple(header + body[:head_keep] + marker + tail), len(body) - keep

    def _reuse(self, prefix: tuple[int, ...]) -> tuple[Any, int]:
        """A KV cache holding the longest beginning of ``prefix`` that a cached prefix shares
        (``prefix`` itself when cached; an empty cache when none shares any), and its length."""
        hit, key, cached_kv = self._prefix_cache.longest_shared(prefix)
        if hit == len(prefix) == len(key):
            return cached_kv, hit
        if cached_kv is None:
            from transformers import DynamicCache

            # No config: every layer keeps all past tokens, so a cached prefix can be cut back;
            # local layers get their window from the masks.
            return DynamicCache(), 0
        kv = copy.deepcopy(cached_kv)
        if len(key) > hit:
            kv.crop(hit - len(key))  # a negative crop removes tokens, in every transformers release
        return kv, hit

    def _extend(self, kv: Any, prefix: tuple[int, ...], cached: int) -> None:
        """Read ``prefix`` past its first ``cached`` tokens into ``kv``, and cache it (again: an
        entry put twice is the same entry, made the most recent)."""
        if cached < len(prefix):
            self._run(prefix[cached:], kv, positions=range(cached, len(prefix)), wide=False)
        self._prefix_cache.put(prefix, kv)

    def _score_branches(
        self, kv: Any, prefix: tuple[int, ...], branches: list[Branch], tail: tuple[int, ...] = ()
    ) -> list[OptionFeatures]:
        """One forward pass over a tree of branches on top of the prefix's KV cache. ``tail``,
        the prefix's last tokens when ``kv`` does not hold them yet, is read in the same pass
        (each of its tokens sees what precedes it, never a branch) and cached with the prefix."""
        tree = build_tree(len(prefix), branches, self._backbone.device)
        start = len(prefix) - len(tail)
        positions = [*range(start, len(prefix)), *tree.positions]
        try:
            wide = any(branch.wide for branch in branches)
            allowed = with_prefix_rows(tree, start)
            mask = self._backbone.attention_mask(allowed, positions, [*range(len(prefix)), *tree.positions])
            hidden = self._run([*tail, *tree.tokens], kv, positions=positions, mask=mask, wide=wide)
        finally:
            extra = kv.get_seq_length() - len(prefix)
            if extra > 0:
                kv.crop(-extra)  # a negative crop removes tokens, in every transformers release
        if tail:
            self._prefix_cache.put(prefix, kv)
        return self._features(hidden.rows(len(tail), len(tree.tokens)), branches, tree)

    def _features(self, hidden: Hidden, branches: list[Branch], tree: Tree) -> list[OptionFeatures]:
        """Per question: the closing-token hidden state and mean log-probability of each option."""
        logprobs = target_logprobs(self._backbone.logits, hidden.last, branches, tree)
        features = []
        for branch, option_spans, end, scores in zip(branches, tree.spans, tree.ends, logprobs, strict=True):
            if branch.wide:
                assert hidden.wide is not None  # _run computes it whenever a branch is wide
                query = hidden.wide[end].float()
                options = self._option_vectors(branch).to(query.device)
                scores = WIDE_MATCH_SCALE * centred_cosine(query, options)
            else:
                query = hidden.last[end].float()
                options = hidden.last[torch.tensor([stop - 1 for _, stop in option_spans], device=query.device)].float()
            features.append(OptionFeatures(branch.question, branch.reading, options, scores, query))
        return features

    def _option_vectors(self, branch: Branch) -> torch.Tensor:
        """``[n_options, hidden]``: each option of a wide choice read as a request's state (see :mod:`clef_guard.engine.wide`)."""

        def prompt(text: str) -> list[int]:
            return [*self._prepare(Job(text, [branch])).prefix, *branch.question_tokens]

        return self._option_cache.read(branch, prompt, self._backbone, self.max_tree_tokens)

    def _run(
        self, tokens: Sequence[int], kv: Any, *, positions: Sequence[int], wide: bool, mask: torch.Tensor | dict[str, torch.Tensor] | None = None
    ) -> Hidden:
        """Decoder forward over ``tokens`` appended to ``kv``: the last layer's states, and
        the penultimate layer's when ``wide`` (a wide choice reads its query there)."""
        device = self._backbone.device
        output = self._backbone.decoder(
            input_ids=torch.tensor([list(tokens)], device=device),
            position_ids=torch.tensor([list(positions)], device=device),
            attention_mask=mask,
            use_cache=kv is not None,
            output_hidden_states=wide,
            **({self._backbone.cache_kw: kv} if kv is not None else {}),
        )
        return Hidden(output.last_hidden_state[0], output.hidden_states[-2][0] if wide else None)

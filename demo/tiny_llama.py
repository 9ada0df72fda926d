"""A tiny Llama-architecture chat model for tests, built in seconds with no downloads.

The tokenizer is a byte-level BPE trained on a built-in corpus of grammar corrections, the
model a two-layer Llama briefly trained on the same corpus in ChatML form, so that it answers
chat requests with corpus-like text rather than noise. It is a stand-in for "gec" wherever a
test needs a real transformers checkpoint but not a real model.
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import TYPE_CHECKING

from mlflow.entities.model_registry import ModelVersion

from demo.registry import log_transformers_checkpoint

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

TINY_DESCRIPTION = "tiny Llama chat model for tests (built and trained in code in seconds, Apache-2.0)"
VOCAB_SIZE = 512
TRAIN_STEPS = 60
MAX_POSITIONS = 512
BOS, EOS, PAD = "<|im_start|>", "<|im_end|>", "<|pad|>"
# ChatML, as SmolLM2-Instruct uses, without its default system prompt.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_SUBJECTS = (  # (subject, third person singular?)
    ("she", True), ("he", True), ("my brother", True), ("the teacher", True), ("our dog", True),
    ("they", False), ("we", False), ("my parents", False), ("the children", False), ("you", False),
)
_VERBS = (  # (base, third person, past, rest of the sentence)
    ("go", "goes", "went", "to school"), ("eat", "eats", "ate", "an apple"),
    ("play", "plays", "played", "football"), ("read", "reads", "read", "a book"),
    ("write", "writes", "wrote", "a letter"), ("walk", "walks", "walked", "to the park"),
    ("watch", "watches", "watched", "a film"), ("drink", "drinks", "drank", "some tea"),
    ("buy", "buys", "bought", "fresh bread"), ("see", "sees", "saw", "a friend"),
    ("make", "makes", "made", "dinner"), ("clean", "cleans", "cleaned", "the kitchen"),
    ("visit", "visits", "visited", "the museum"), ("sing", "sings", "sang", "a song"),
    ("drive", "drives", "drove", "to work"), ("study", "studies", "studied", "for the exam"),
)
_TIMES = ("every day", "yesterday", "on Sundays", "last week")


def _correction(subject: str, singular: bool, verb: tuple[str, str, str, str], when: str) -> tuple[str, str]:
    """One (wrong, right) sentence pair: past tense for past times, agreement otherwise."""
    base, third, past, rest = verb
    right_verb = past if when in ("yesterday", "last week") else (third if singular else base)
    wrong_verb = base if right_verb != base else third
    wrong = f"{subject} {wrong_verb} {rest} {when}."
    right = f"{subject} {right_verb} {rest} {when}."
    return wrong, right[0].upper() + right[1:]


def corpus() -> list[tuple[str, str]]:
    """The built-in corpus: 640 (ungrammatical, corrected) sentence pairs, always the same."""
    return [
        _correction(subject, singular, verb, when)
        for (subject, singular), verb, when in itertools.product(_SUBJECTS, _VERBS, _TIMES)
    ]


def chat_texts() -> list[str]:
    """The corpus as ChatML conversations: the user asks for a fix, the assistant gives it."""
    return [
        f"{BOS}user\nFix: {wrong}{EOS}\n{BOS}assistant\n{right}{EOS}\n" for wrong, right in corpus()
    ]


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with about `VOCAB_SIZE` tokens and a ChatML chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(chat_texts(), trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=BOS, eos_token=EOS, pad_token=PAD)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.model_max_length = MAX_POSITIONS
    return tokenizer


def _train(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, seed: int, steps: int = TRAIN_STEPS
) -> None:
    """A few AdamW steps of next-token prediction on the chat corpus (about a second on CPU)."""
    import torch

    texts = chat_texts()
    order = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(steps):
        batch = tokenizer(order.sample(texts, 32), return_tensors="pt", padding=True)
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        loss = model(**batch, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


def build_tiny_llama(out_dir: Path, seed: int = 0) -> Path:
    """Build the tiny Llama and its tokenizer into `out_dir` as a float32 safetensors checkpoint.

    The same seed gives the same weights. float32 keeps the reference outputs of a model this
    small free of bf16 rounding, so quantization tests measure quantization only.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out_dir = Path(out_dir)
    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        # head_dim = 64 / 2 = 32: the smallest head size vLLM's CPU attention supports.
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=len(tokenizer),
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    model = LlamaForCausalLM(config)
    _train(model, tokenizer, seed)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def log_tiny_llama(
    tracking_uri: str, checkpoint_dir: Path, registered_model_name: str = "tiny-llm"
) -> ModelVersion:
    """Log the tiny Llama checkpoint as an MLflow chat model and register a new version."""
    return log_transformers_checkpoint(tracking_uri, checkpoint_dir, registered_model_name, TINY_DESCRIPTION)

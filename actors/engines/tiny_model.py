"""A tiny causal LM and tokenizer built on the spot, deterministically, for tests and the demo.

No model hub is reachable here, so the model is made, not downloaded: a byte-level BPE tokenizer
trained on a few embedded lines (with a chat template that carries tool calls) and a two-layer Qwen2
with seeded random weights. Rebuilding with the same seed gives byte-identical files.

    parkway model build DIR [--seed N]
"""

from __future__ import annotations

from pathlib import Path

# Text in the shape the agents speak: the tokenizer learns its pieces, the model knows its vocabulary.
CORPUS = [
    '<tool>{"name": "increment", "arguments": {"by": 3}}</tool>',
    '<tool>{"name": "transfer", "arguments": {"src": "a", "dst": "b", "amount": 5}}</tool>',
    '<tool>{"name": "add_event", "arguments": {"title": "review", "day": 12}}</tool>',
    "<answer>42</answer> the balance of a is 100 and b is 120",
    "task: reach the target with the tools\ntools: increment(by:int); get()\nturns: 5",
    "Plan my week: add meetings and todos, then summarise.",
    "Move money from a to b, then report all balances.",
    "let me think about the next step first, then call a tool",
    '{"ok": true, "output": {"value": 3}}',
]

SPECIAL = ["<|pad|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_model(directory: Path, *, seed: int = 0, vocab_size: int = 512) -> Path:
    """Write tokenizer and model files into ``directory`` and return it."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(CORPUS * 4, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, pad_token="<|pad|>", bos_token="<|im_start|>", eos_token="<|im_end|>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",  # the name transformers 5 gives it (torch_dtype is its deprecated alias)
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for parameter in model.parameters():  # a little wider than the default, so logits are not flat
            parameter.normal_(0.0, 0.08)
    model.save_pretrained(directory, safe_serialization=True)
    return directory

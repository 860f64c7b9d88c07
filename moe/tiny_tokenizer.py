"""A small, deterministic byte-level BPE tokenizer for the tiny test checkpoints.

Trained with the `tokenizers` library on an embedded corpus, so every call gives the same vocabulary
(ids 0..2 are `<|bos|>`, `<|eos|>`, `<|pad|>`, as in DeepSeek-V3 where bos=0 and eos=1). It prepends
`<|bos|>` on encode (like DeepSeek's tokenizer) and carries a Jinja chat template.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
SPECIAL_TOKENS = [BOS, EOS, PAD, *ROLE_TOKENS]
VOCAB_SIZE = 512

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Once upon a time, in a small village by the sea, there lived an old fisherman and his three daughters.
Every morning he rowed out past the lighthouse, and every evening he came home with stories to tell.
The weather today is mostly sunny with a light breeze from the west; tomorrow will bring rain.
Scientists measured the temperature of the lake at 14.5 degrees, which is warmer than last year.
Mixture-of-experts models route each token to a few experts, so only part of the network runs per token.
The router scores every expert, keeps the top k, and the chosen experts' outputs are summed with weights.
Attention compresses keys and values into a latent vector; the cache stores that vector for every token.
Please write a short poem about autumn leaves falling in the park while children play nearby.
What is the capital of France? The capital of France is Paris, a city known for art and food.
How many days are there in a leap year? There are 366 days in a leap year, and 365 in other years.
Explain why the sky is blue. Sunlight scatters off molecules in the air, and blue light scatters most.
She opened the window, listened to the birds, and decided that the letter could wait until Monday.
def add(a, b):
    return a + b

for i in range(10):
    print(i * i)

import json
data = {"name": "tiny", "layers": 4, "experts": [0, 1, 2, 3]}
print(json.dumps(data, indent=2))
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 2048 4096 3.14159 2.71828 -1 +7 50%
Punctuation: (parentheses) [brackets] {braces} <angles> "quotes" 'apostrophes' commas, colons: semicolons;
Questions? Answers! Ellipses... hyphen-ated words, under_scores, slashes/and\\backslashes, #hash @at $dollar.
In the beginning the engineers built a scheduler, a block manager, and a model runner. The scheduler
picks which requests run next, the runner executes the model, and the engine records the new tokens.
Servers receive requests over HTTP, stream tokens back to clients, and report metrics for monitoring.
The library opens at nine o'clock and closes at six; on Sundays it is closed all day for cleaning.
Bread, butter, milk, eggs, apples, oranges, rice, beans, tomatoes, onions, garlic, pepper and salt.
Mountains rise above the valley where rivers wind through forests of pine, oak, birch and maple trees.
History teaches that empires rise and fall, that ideas travel along trade routes, and that people adapt.
Good morning! How are you today? I am fine, thank you. Would you like a cup of tea or some coffee?
The committee will meet on Thursday to review the budget, discuss the schedule, and vote on proposals.
Mathematics: if x = 3 and y = 4, then x * x + y * y = 25, so the hypotenuse is 5 units long.
A user asked the assistant to summarize the article; the assistant replied with three clear sentences.
Water boils at 100 degrees Celsius at sea level, but at lower temperatures high in the mountains.
The orchestra tuned their instruments, the lights dimmed, and the audience fell silent as music began.
Keep each file small, put shapes in names, and make errors say what was wrong and what to do about it.
"""


def _train_backend(lines, vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def train_tokenizer(lines, vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on `lines` (an iterable of strings), with this module's special tokens
    and chat template, wrapped for transformers. Deterministic for the same lines."""
    tok = PreTrainedTokenizerFast(
        tokenizer_object=_train_backend(lines, vocab_size),
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=ROLE_TOKENS,
        add_bos_token=True,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Train the tiny tokenizer (deterministic, ~0.1 s) and wrap it for transformers."""
    return train_tokenizer(CORPUS.splitlines(keepends=True), VOCAB_SIZE)

"""The model zoo (issue #53): one small model per family a user trains, as `[[models]]` entries; the suite's
zoo test (test_zoo.py) and `python -m bench.zoo` (through `memplan run`) share them."""

from __future__ import annotations

from typing import Any

VOCAB, SEQ, BATCH = 256, 16, 2
TOKENS = {"shape": [SEQ], "dtype": "int64", "high": VOCAB}
IMAGE = {"shape": [3, 32, 32]}
CLASSES = {"shape": [], "dtype": "int64", "high": 10}

LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=VOCAB, max_position_embeddings=64)
GPT2 = dict(n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=64, bos_token_id=0, eos_token_id=0,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)

FACTORIES = '''
import transformers
from torchvision.models import efficientnet as torchvision_efficientnet


def efficientnet(width_mult, depth_mult, **kwargs):
    """torchvision's EfficientNet-B0 blocks (SiLU, squeeze-excite, stochastic depth) at a fraction of its width and
    depth: torchvision's `efficientnet_b0` builder fixes both."""
    setting, last_channel = torchvision_efficientnet._efficientnet_conf("efficientnet_b0", width_mult=width_mult,
                                                                        depth_mult=depth_mult)
    return torchvision_efficientnet.EfficientNet(setting, dropout=0.2, last_channel=last_channel, **kwargs)

def vit(**kwargs):
    """A tiny ViT image classifier (transformers has no Auto class entry in memplan's list for it)."""
    return transformers.ViTForImageClassification(transformers.ViTConfig(**kwargs))
'''
"""The factories the families below name (`factory = "zoo_factories:..."`), written beside the pipeline file."""

FAMILIES: dict[str, dict[str, Any]] = {
    "bert-mlm": dict(transformers="bert", auto_class="AutoModelForMaskedLM", loss="labels", inputs=[TOKENS, TOKENS],
                     kwargs=dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                 intermediate_size=128, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                 attention_probs_dropout_prob=0.0)),
    "t5-seq2seq": dict(transformers="t5", auto_class="AutoModelForSeq2SeqLM", loss="labels",
                       inputs=[TOKENS, {"shape": [8], "dtype": "int64", "high": VOCAB}],
                       kwargs=dict(vocab_size=VOCAB, d_model=64, d_kv=32, d_ff=128, num_layers=1, num_decoder_layers=1,
                                   num_heads=2, dropout_rate=0.0)),
    "gpt2": dict(transformers="gpt2", loss="causal_lm", inputs=[TOKENS], kwargs=GPT2),
    "llama-gqa": dict(transformers="llama", loss="causal_lm", inputs=[TOKENS], kwargs=LLAMA),
    "qwen2-gqa": dict(transformers="qwen2", loss="causal_lm", inputs=[TOKENS], kwargs=LLAMA),
    "mistral-sliding": dict(transformers="mistral", loss="causal_lm", inputs=[TOKENS],
                            kwargs=dict(LLAMA, sliding_window=8)),
    "efficientnet": dict(factory="zoo_factories:efficientnet", loss="cross_entropy", inputs=[IMAGE, CLASSES],
                         kwargs=dict(num_classes=10, width_mult=0.25, depth_mult=0.5, stochastic_depth_prob=0.2)),
    "mobilenet-v3": dict(torchvision="mobilenet_v3_small", loss="cross_entropy", inputs=[IMAGE, CLASSES],
                         kwargs=dict(num_classes=10, width_mult=0.25)),
    "vit": dict(factory="zoo_factories:vit", loss="cross_entropy", inputs=[IMAGE, CLASSES],
                kwargs=dict(image_size=32, patch_size=8, num_channels=3, hidden_size=64, num_hidden_layers=2,
                            num_attention_heads=2, intermediate_size=128, num_labels=10, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0)),
    "gpt2-bf16": dict(transformers="gpt2", loss="causal_lm", inputs=[TOKENS], kwargs=GPT2, dtype="bfloat16"),
    "mobilenet-autocast": dict(torchvision="mobilenet_v3_small", loss="cross_entropy", inputs=[IMAGE, CLASSES],
                               kwargs=dict(num_classes=10, width_mult=0.25), autocast="bfloat16"),
}
"""One small model per family, as `[[models]]` entries (less `name` and `batch_sizes`)."""

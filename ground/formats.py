"""Constants of the formats the stages hand each other (docs/formats.md), read by more than one stage.

The pipeline writes token shards whose documents each end in EOT; training packs them as they are, the HF export
declares EOT as its eos token, and serving conditions every prompt on it. One definition, so the stages cannot
drift apart.

The fill-in-the-middle sentinels (Bavarian et al. 2022, "Efficient Training of Language Models to Fill in the
Middle") are special tokens of every tokenizer the pipeline trains: training with ``fim`` rearranges documents around
them (train/fim.py), and a prompt sent to the server in the same format means what it meant in training.
"""

EOT = "<|endoftext|>"  # the end-of-document token of every tokenizer.json the pipeline writes or accepts
FIM_PREFIX = "<|fim_prefix|>"
FIM_SUFFIX = "<|fim_suffix|>"
FIM_MIDDLE = "<|fim_middle|>"
FIM_TOKENS = (FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE)
